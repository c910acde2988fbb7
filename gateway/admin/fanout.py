"""Admin changes that reach every worker process (``serve --workers``,
``gateway.workers.supervisor``).

Worker 0 serves the admin API. An action that changes how the gateway routes (policy and
weights, drain and undrain, aliases and rollbacks, reload) changes only the process that ran
it, so once it succeeded there it is numbered in the journal (``gateway.admin.journal``) and
sent, as it came (method, path, body, token), to every other worker's private admin socket,
marked with its number in ``X-Gateway-Fanout``. The answer says how many workers applied it
(``X-Gateway-Workers: 2/2``); a worker that refused or could not be reached is logged
(``admin_fanout_failed``). Actions on the backends themselves (loading a LoRA adapter) run
once, from worker 0, and are neither journaled nor sent on.

The other workers take changes in worker 0's order only: one already applied is answered 200
and not applied again; one ahead of a change they missed is refused (409) and what they
missed fetched from the others' journals and replayed first (``CatchUp``), the refused one
with it. A worker started again after it died (worker 0 too) replays every change from the
others' journals before it takes traffic, so it routes as they do. A change sent to another
worker than worker 0 directly is refused: it would make that worker differ from the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from backends.errors import AdminConflict, InvalidRequest
from gateway.admin.fleet import CHANGE_BODY
from gateway.admin.journal import AdminJournal, Entry, Fetched
from gateway.keys import ADMIN_JOURNAL, GATEWAY
from gateway.workers.supervisor import APPLIED_HEADER, FANOUT_HEADER, ask_peer

log = structlog.get_logger("gateway.admin.api")

_ONCE: Final = ("/admin/lora/",)  # acts on the backends: once for the host, not per worker
_TIMEOUT_S: Final = 10.0
JOURNAL_PATH: Final = "/admin-journal"  # on each worker's private socket: ?after=<seq>
_PASSES: Final = 5  # catch-up rounds before it waits for the next change to try again


def fanout_middleware(journal: AdminJournal, peers: Sequence[Path], origin: bool) -> Middleware:
    """``origin``: this is worker 0, where changes start; ``peers``: the other workers' admin
    sockets it sends them on to."""

    @web.middleware
    async def fanout(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method in ("GET", "HEAD") or request.path.startswith(_ONCE):
            return await handler(request)
        numbered = request.headers.get(FANOUT_HEADER)
        if numbered is not None:
            return await _take(request, handler, journal, numbered)
        if not origin:
            raise AdminConflict(
                "Admin changes go to worker 0 (the admin port): a change made on one worker "
                "alone would make it route unlike the others."
            )
        response = await handler(request)
        if not 200 <= response.status < 300:
            return response
        body = request.get(CHANGE_BODY) or await request.read()  # a made key: its hash only
        entry = journal.append(request.method, request.path_qs, request.content_type, body)
        results = await asyncio.gather(*(_send(p, request, entry) for p in peers))
        response.headers[APPLIED_HEADER] = f"{1 + sum(results)}/{1 + len(peers)}"
        return response

    return fanout


async def _take(
    request: web.Request, handler: Handler, journal: AdminJournal, numbered: str
) -> web.StreamResponse:
    """A change numbered by worker 0 (sent on by it, or replayed from a journal)."""
    try:
        seq = int(numbered)
    except ValueError:
        raise InvalidRequest(f"{FANOUT_HEADER} must be a change's number") from None
    due = journal.due(seq)
    if due is None:
        return web.json_response({"already_applied": seq})
    if not due:
        catch_up = request.app.get(CATCH_UP)
        if catch_up is not None:
            catch_up.soon()
        raise AdminConflict(
            f"change {seq} is ahead of the last one applied here ({journal.last}): "
            "the ones between are being fetched first"
        )
    body = await request.read()
    # Taken before it is applied: the next change, arriving meanwhile, is not a gap.
    journal.take(Entry(seq, request.method, request.path_qs, request.content_type, body))
    return await handler(request)


async def _send(socket: Path, request: web.Request, entry: Entry) -> bool:
    headers = {
        FANOUT_HEADER: str(entry.seq),
        "Authorization": request.headers.get("Authorization", ""),
    }
    if entry.content_type:
        headers["Content-Type"] = entry.content_type
    answer = await ask_peer(
        socket, entry.method, entry.path_qs, within=_TIMEOUT_S, body=entry.body, headers=headers
    )
    if isinstance(answer, str):
        why = answer
    elif 200 <= answer[0] < 300:
        return True
    else:
        why = f"status {answer[0]}: {answer[1][:200].decode(errors='replace')}"
    log.warning("admin_fanout_failed", socket=socket.name, path=request.path, error=why)
    return False


class CatchUp:
    """Fetches the changes this worker lacks from the other workers' journals and applies
    them, in order, through its own admin socket (as if worker 0 had sent them)."""

    def __init__(
        self, journal: AdminJournal, journals: Sequence[Path], own_admin: Path, token: str
    ) -> None:
        self.journal = journal
        self._journals = journals  # the other workers' private sockets
        self._own = own_admin
        self._token = token
        self._task: asyncio.Task[int] | None = None

    def soon(self) -> None:
        """Catch up in the background (a change arrived ahead of one missed)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name="admin-catch-up")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def run(self) -> int:
        """Replay what the others hold beyond this worker's last change; how many were."""
        replayed = 0
        for _ in range(_PASSES):
            fetched = await self._fetch()
            if fetched is None:
                return replayed
            if fetched.missing:  # dropped from every journal: cannot be had
                log.warning(
                    "admin_replay_partial",
                    missing=fetched.missing,
                    after=self.journal.last,
                )
                self.journal.skip_to(self.journal.last + fetched.missing)
            if not fetched.entries or fetched.last <= self.journal.last:
                return replayed
            for entry in fetched.entries:
                if self.journal.due(entry.seq) is not True:
                    continue  # already here (sent on meanwhile), or a gap: next pass
                if not await self._apply(entry):
                    return replayed
                replayed += 1
        return replayed

    async def _fetch(self) -> Fetched | None:
        """The longest journal beyond this worker's last change among the others'."""
        after = self.journal.last
        answers = await asyncio.gather(
            *(
                ask_peer(p, "GET", f"{JOURNAL_PATH}?after={after}", within=_TIMEOUT_S)
                for p in self._journals
            )
        )
        best: Fetched | None = None
        for socket, answer in zip(self._journals, answers, strict=True):
            if isinstance(answer, str) or answer[0] != 200:
                why = answer if isinstance(answer, str) else f"status {answer[0]}"
                log.info("admin_journal_unreachable", socket=socket.name, error=why)
                continue
            fetched = AdminJournal.from_json(json.loads(answer[1]))
            if best is None or (fetched.last, -fetched.missing) > (best.last, -best.missing):
                best = fetched
        return best

    async def _apply(self, entry: Entry) -> bool:
        headers = {FANOUT_HEADER: str(entry.seq), "Authorization": f"Bearer {self._token}"}
        if entry.content_type:
            headers["Content-Type"] = entry.content_type
        answer = await ask_peer(
            self._own,
            entry.method,
            entry.path_qs,
            within=_TIMEOUT_S,
            body=entry.body,
            headers=headers,
        )
        if isinstance(answer, str):
            log.warning("admin_replay_failed", seq=entry.seq, path=entry.path_qs, error=answer)
            return False
        status = answer[0]
        if 200 <= status < 300:
            log.info("admin_replayed", seq=entry.seq, method=entry.method, path=entry.path_qs)
        else:  # refused here though worker 0 took it: said, and passed over
            log.warning("admin_replay_refused", seq=entry.seq, path=entry.path_qs, status=status)
        return True


CATCH_UP: Final = web.AppKey("admin_catch_up", CatchUp)  # on the admin app of a worker


async def reload_everywhere(first: Path, token: str) -> None:
    """SIGHUP with ``serve --workers`` and the admin API on: the reload asked of worker 0 (on
    its admin socket ``first``) as an admin change, so it is numbered, sent on to every worker,
    and replayed in its place among the others by a worker started again (which starts from
    the configuration the workers started with, so it needs the reload where it was)."""
    answer = await ask_peer(
        first,
        "POST",
        "/admin/reload",
        within=_TIMEOUT_S,
        headers={"Authorization": f"Bearer {token}"},
    )
    if isinstance(answer, str) or answer[0] != 200:
        why = answer if isinstance(answer, str) else answer[1][:200].decode(errors="replace")
        log.warning("reload_refused", error=why)


async def journal_handler(request: web.Request) -> web.Response:
    """``GET /admin-journal?after=N`` on a worker's private socket: the changes after N."""
    try:
        after = int(request.query.get("after", "0"))
    except ValueError:
        raise web.HTTPBadRequest(text="after: a change's number") from None
    return web.json_response(request.app[GATEWAY][ADMIN_JOURNAL].to_json(after))
