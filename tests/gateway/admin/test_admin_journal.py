"""The admin journal of ``serve --workers``: changes numbered by worker 0, taken in order by
the others, and what a worker missed fetched from the others and replayed (``CatchUp``).

Two workers' gateways run in this process, each with its admin API and private app on Unix
sockets as ``serve --workers`` lays them out, so what is tested is the real admin API over
real sockets; the forked supervisor is ``test_workers.py``'s."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from backends.shared_inflight import SharedInFlight, table_bytes
from gateway.admin.api import create_admin_app
from gateway.admin.fanout import CATCH_UP
from gateway.admin.journal import AdminJournal
from gateway.app import create_app, worker_private_app
from gateway.config.settings import Settings
from gateway.keys import ADMIN_JOURNAL, POOL
from gateway.server import make_runner
from gateway.workers.supervisor import APPLIED_HEADER, FANOUT_HEADER, Worker
from tests.waiting import wait_for

TOKEN = "journal-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BACKENDS = ["http://127.0.0.1:9", "http://127.0.0.1:11"]  # nothing listens: only drained


def test_changes_are_numbered_taken_once_in_order_and_the_oldest_dropped() -> None:
    origin, other = AdminJournal(), AdminJournal(max_entries=3, max_bytes=1000)
    for i in range(1, 6):
        entry = origin.append("PUT", f"/admin/x/{i}", "application/json", b"{}")
        assert entry.seq == i
        assert other.due(i) is True
        other.take(entry)
        assert other.due(i) is None  # already applied
    assert other.due(7) is False  # 6 missing
    fetched = other.after(0)  # it kept 3, 4, 5: 1 and 2 cannot be had from it
    assert [e.seq for e in fetched.entries] == [3, 4, 5]
    assert fetched.missing == 2
    assert AdminJournal.from_json(other.to_json(3)).entries == origin.after(3).entries
    assert AdminJournal.from_json(other.to_json(5)) == origin.after(5)  # nothing, none missing
    big = AdminJournal(max_bytes=10)
    big.take(origin.append("PUT", "/admin/x", "", b"x" * 8))
    big.take(origin.append("PUT", "/admin/x", "", b"y" * 8))
    assert [e.body for e in big.after(0).entries] == [b"y" * 8]  # the bytes bound too


@dataclass
class Host:
    """Two workers' gateways with their admin and private sockets, in one process."""

    shm: shared_memory.SharedMemory
    sockets: Path
    worker: list[Worker] = field(default_factory=list)
    apps: list[web.Application] = field(default_factory=list)
    admins: list[web.Application] = field(default_factory=list)
    runners: list[list[web.AppRunner]] = field(default_factory=list)  # each worker's
    sites: list[web.UnixSite] = field(default_factory=list)  # each worker's admin socket

    async def start(self, index: int, restarted: bool = False) -> None:
        w = Worker(index, 2, SharedInFlight(self.shm.buf, 2, index), self.sockets, restarted)
        settings = Settings(
            backends=BACKENDS,
            admin={"token": TOKEN},
            health={"interval": 60},
            log_level="warning",
        )
        app = create_app(settings, worker=w)
        admin = create_admin_app(app, TOKEN)
        runners = [make_runner(app, shutdown_timeout=0.5)]
        await runners[0].setup()
        site = None
        for what, sock in (
            (worker_private_app(app), w.private_socket(index)),
            (admin, w.admin_socket(index)),
        ):
            runners.append(make_runner(what))
            await runners[-1].setup()
            site = web.UnixSite(runners[-1], str(sock))
            await site.start()
        assert site is not None
        if index < len(self.worker):
            self.worker[index], self.apps[index], self.admins[index] = w, app, admin
            self.runners[index], self.sites[index] = runners, site
        else:
            self.worker.append(w)
            self.apps.append(app)
            self.admins.append(admin)
            self.runners.append(runners)
            self.sites.append(site)

    async def stop(self, index: int) -> None:
        for r in reversed(self.runners[index]):
            await r.cleanup()
        self.runners[index] = []
        self.worker[index].table.release()

    async def restart(self, index: int) -> int:
        """Worker ``index`` dies and starts again: the changes it replayed."""
        await self.stop(index)
        await self.start(index, restarted=True)
        return await self.admins[index][CATCH_UP].run()

    async def ask(
        self, index: int, method: str, path: str, *, json: Any = None, **headers: str
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        connector = aiohttp.UnixConnector(path=str(self.worker[index].admin_socket(index)))
        async with (
            aiohttp.ClientSession(connector=connector) as s,
            s.request(method, "http://w" + path, json=json, headers=AUTH | headers) as r,
        ):
            return r.status, await r.json(), dict(r.headers)

    def draining(self, index: int) -> set[str]:
        return {b.id for b in self.apps[index][POOL].all() if b.draining}

    async def stop_admin(self, index: int) -> None:
        await self.sites[index].stop()

    async def start_admin(self, index: int) -> None:
        path = str(self.worker[index].admin_socket(index))
        self.sites[index] = web.UnixSite(self.runners[index][-1], path)
        await self.sites[index].start()


@asynccontextmanager
async def host() -> AsyncIterator[Host]:
    shm = shared_memory.SharedMemory(create=True, size=table_bytes(2))
    try:
        with tempfile.TemporaryDirectory(prefix="journal-") as tmp:
            h = Host(shm, Path(tmp))
            try:
                for i in range(2):
                    await h.start(i)
                yield h
            finally:
                for i in range(len(h.runners)):
                    if h.runners[i]:
                        await h.stop(i)
    finally:
        with contextlib.suppress(BufferError):  # a start that failed half-way left a view
            shm.close()
        shm.unlink()


async def test_a_change_reaches_the_other_worker_once_and_only_from_worker_0() -> None:
    async with host() as h:
        status, _, headers = await h.ask(0, "POST", "/admin/backends/nowhere:1/drain")
        assert status == 404  # a refused change is neither numbered nor sent on
        assert h.apps[0][ADMIN_JOURNAL].last == 0
        a = h.apps[0][POOL].all()[0].id
        status, _, headers = await h.ask(0, "POST", f"/admin/backends/{a}/drain")
        assert status == 200
        assert headers[APPLIED_HEADER] == "2/2"
        assert h.draining(1) == {a}
        assert h.apps[1][ADMIN_JOURNAL].last == 1
        # Sent again (a retry of worker 0's): answered, not applied twice.
        await h.ask(1, "POST", f"/admin/backends/{a}/undrain", **{FANOUT_HEADER: "1"})
        assert h.draining(1) == {a}
        # Made on worker 1 alone: refused, in OpenAI's error shape.
        status, doc, _ = await h.ask(1, "POST", f"/admin/backends/{a}/undrain")
        assert status == 409
        assert doc["error"]["code"] == "admin_conflict"
        assert h.draining(1) == {a}
        status, _, _ = await h.ask(
            1, "POST", f"/admin/backends/{a}/undrain", **{FANOUT_HEADER: "x"}
        )
        assert status == 400


async def test_a_worker_that_missed_changes_fetches_them_before_the_next() -> None:
    async with host() as h:
        a, b = (x.id for x in h.apps[0][POOL].all())
        await h.stop_admin(1)  # worker 1 cannot be reached: it misses the first two
        change = {"policy": "least_load", "weights": {"active": 7, "queue": 1, "kv": 0}}
        status, _, headers = await h.ask(0, "PUT", "/admin/policy", json=change)
        assert (status, headers[APPLIED_HEADER]) == (200, "1/2")
        status, _, _ = await h.ask(0, "POST", f"/admin/backends/{a}/drain")
        assert status == 200
        await h.start_admin(1)
        # The third arrives ahead of the two missed: refused, and those fetched and replayed.
        status, _, headers = await h.ask(0, "POST", f"/admin/backends/{b}/drain")
        assert (status, headers[APPLIED_HEADER]) == (200, "1/2")
        await wait_for(lambda: h.apps[1][ADMIN_JOURNAL].last == 3, what="worker 1 caught up")
        assert h.draining(1) == {a, b}
        status, doc, _ = await h.ask(1, "GET", "/admin/policy")
        assert doc["weights"]["active"] == 7
        status, _, headers = await h.ask(0, "POST", f"/admin/backends/{b}/undrain")
        assert headers[APPLIED_HEADER] == "2/2"  # in step again
        assert h.draining(1) == {a}


async def test_a_restarted_worker_replays_what_the_other_holds_partial_when_dropped() -> None:
    async with host() as h:
        a, b = (x.id for x in h.apps[0][POOL].all())
        for path in (f"{a}/drain", f"{b}/drain", f"{a}/undrain"):
            await h.ask(0, "POST", f"/admin/backends/{path}")
        # Worker 0 starts again knowing nothing: it replays worker 1's journal, numbered as
        # it was, and numbers its next change after those.
        assert await h.restart(0) == 3
        assert h.draining(0) == {b}
        assert h.apps[0][ADMIN_JOURNAL].last == 3
        _, _, headers = await h.ask(0, "POST", f"/admin/backends/{b}/undrain")
        assert headers[APPLIED_HEADER] == "2/2"
        assert h.draining(1) == set()
        # What no journal holds any longer is said (admin_replay_partial), the rest replayed.
        h.apps[0][ADMIN_JOURNAL].max_entries = 1  # from its next change on, it keeps one
        await h.ask(0, "POST", f"/admin/backends/{a}/drain")
        assert await h.restart(1) == 1
        assert h.apps[1][ADMIN_JOURNAL].last == 5
        assert h.draining(1) == {a}


@pytest.mark.parametrize("after", ["x", ""])
async def test_the_journal_asked_with_a_bad_number_is_a_clear_400(after: str) -> None:
    async with host() as h:
        sock = str(h.worker[1].private_socket(1))
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock)) as s,
            s.get(f"http://w/admin-journal?after={after}") as r,
        ):
            assert r.status == 400
