"""The soak's Redis faults, under the load: Redis paused (SIGSTOP) for a few seconds, and killed
then started again empty on its port, with admin changes made around and during each. What
became of every change, every read of the fleet's views and the state of every replica before
and after are recorded here and judged by ``loadtest.soak.changes``.

Both faults act on the run's own ``redis-server`` (``Fleet.redis``, started by the soak on a
free port), never on a Redis of the machine's.

**A pause**: the views are read (so that their last state is known); a burst of keys is made,
a few ms apart, through both replicas, and Redis is stopped in the middle of it (some calls
answered before, some caught between their write and its answer, some after); at once a key is
made through replica 0 while the same call (the same ``Idempotency-Key``) goes through replica
1, and the policy's weights are changed through replica 1; every view of every replica is read
again and again meanwhile. Redis is resumed after ``hold`` seconds, whatever the calls answered
(a change waits for Redis 1.5 x ``fleet.log_timeout`` at most, 3 s: the answers come within the
pause). The burst's keys are revoked at the end.

**An empty restart**: a key made and a budget changed (answered 200 as on any day); every
replica's state and the budget key's spent count read; Redis killed; the weights changed while
it is dead (503 expected) and again as soon as it is back, empty (503 while the log is healed);
views read throughout, and every replica's state read again and again (it must never be
another than before, not even for a moment); once every replica says its log is whole, every
replica's state and spent count read again, and the budget changed once more.

Then each change's fate is polled on every replica until they all tell the same settled one,
its effect read on every replica's state, the same call repeated once more through another
replica, and its fate and effect read again; its entries are counted in the audit trail unless
it was made before the log was lost (the healed log starts from a snapshot: the entries before
are gone from the trail, the ids are kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

from loadtest.soak.changes import (
    SETTLED,
    STATE_PATHS,
    VIEWS,
    Call,
    KeyedChange,
    LogLoss,
    Outage,
    ViewRead,
    count,
    drift,
    log_events,
    state_part,
)
from loadtest.soak.config import ALIAS
from loadtest.soak.faults import FaultWindow, PlannedFault
from loadtest.soak.fleet import REPLICAS, Fleet

Clock = Callable[[], float]
BUDGET_KEY: Final = "soak-budget"  # a run-time key with a budget: its spent count is in Redis
BUDGET: Final = 1_000_000_000  # tokens a day: never reached
CALL_S: Final = 20.0  # an admin call must be answered by then (a 202 is due within seconds)
READ_S: Final = 10.0  # a view or a fate must be answered by then
SETTLE_S: Final = 30.0  # a change's fate known alike on every replica by then
WHOLE_S: Final = 45.0  # the log healed and whole on every replica by then
READ_EVERY_S: Final = 0.3
WATCH_EVERY_S: Final = 0.01  # each replica's state while the log is lost and healed
# Keys made a few ms apart as Redis is stopped: some answered before (200), some caught in the
# middle (in the log, not applied within the wait: 202 pending; sent, no answer: 202 unknown),
# the rest after (503), as a pause strikes a busy admin API. The stop comes after the last is
# sent; on an idle 2-core host 25 ms is about when the first ones reach Redis.
BURST: Final = 8
BURST_STEP_S: Final = 0.003
BURST_STOP_S: Final = 0.025
_POLL_S: Final = 0.1


@dataclass(frozen=True, slots=True)
class Intent:
    """A change to make with an ``Idempotency-Key``, and how a replica's state shows it made."""

    key: str
    phase: str
    method: str
    path: str
    body: Any
    shows: Callable[[dict[str, Any]], bool]  # on ``fleet_state``'s document
    counted: bool = True  # its entries counted in the audit trail

    @property
    def what(self) -> str:
        return f"{self.method} {self.path} {_short(self.body)}"


@dataclass(slots=True)
class Made:
    """An intent's calls so far, then its fate once settled."""

    intent: Intent
    calls: list[Call] = field(default_factory=list)
    settled: tuple[str, ...] = ()
    effect_settled: tuple[bool, ...] = ()


@dataclass(slots=True)
class RedisFaults:
    fleet: Fleet
    ops: aiohttp.ClientSession
    clock: Clock
    changes: list[KeyedChange] = field(default_factory=list)
    reads: list[ViewRead] = field(default_factory=list)
    outages: list[Outage] = field(default_factory=list)
    losses: list[LogLoss] = field(default_factory=list)
    budget_made: bool = False
    _phases: int = 0

    # -- the faults ----------------------------------------------------------------------------

    async def pause(self, f: PlannedFault) -> FaultWindow:
        n = await self._begin()
        key = self._new_key("pause", n)
        weights = self._weights("pause", n)
        burst = [self._new_key("pause", n, f"-{i}") for i in range(BURST)]
        await self._sweep()  # the views' last state known
        stop = asyncio.Event()
        reader = asyncio.create_task(self._read_views(stop))
        start = self.clock()
        sent = [
            asyncio.create_task(self._call(b, i % REPLICAS, after=i * BURST_STEP_S))
            for i, b in enumerate(burst)
        ]
        try:
            await asyncio.sleep(BURST_STOP_S)  # sleep-ok: stopped amid the burst
            self.fleet.pause_redis()
            away = self.clock()
            sent += [
                asyncio.create_task(self._call(key, 0)),
                asyncio.create_task(self._call(key, 1)),  # the same key through another replica
                asyncio.create_task(self._call(weights, 1)),
            ]
            await asyncio.sleep(f.hold)  # sleep-ok: Redis stays paused this long
        finally:
            back = self.clock()
            self.fleet.resume_redis()
        self.outages.append(Outage("redis_pause", away, back))
        try:
            answered = await asyncio.gather(*sent)
        finally:
            stop.set()
            await reader
        made = [Made(b, [answered[i]]) for i, b in enumerate(burst)]
        made += [Made(key, list(answered[BURST : BURST + 2])), Made(weights, [answered[-1]])]
        problems = await self._settle(made)
        problems += await self._finish(made)
        for b in burst:  # the burst's keys revoked: no series of their own for the rest of the run
            name = b.body["name"]
            gone = await self.fleet.call_admin(
                self.ops, 0, "DELETE", f"/admin/keys/{name}", within=CALL_S
            )
            if gone.status != 200:
                problems.append(f"{name} not revoked: {gone.status}")
        return FaultWindow("redis_pause", None, start, self.clock(), not problems, _say(problems))

    async def restart_empty(self, f: PlannedFault) -> FaultWindow:
        n = await self._begin()
        restarts = sum(1 for o in self.outages if o.kind == "redis_kill") + 1
        before = [
            await self._made(self._new_key("before_restart", n, counted=False), 0),
            await self._made(self._budget("before_restart", n, counted=False), 1),
        ]
        problems = await self._settle(before)
        states, spent = await self._states(), await self._spent()
        logged = self._logged()
        stop = asyncio.Event()
        reader = asyncio.create_task(self._read_views(stop))
        watched: list[tuple[float, int, dict[str, Any] | None]] = []
        watcher = asyncio.create_task(self._watch(watched, stop))
        start = self.clock()
        dead = Made(self._weights("restart", n))
        try:
            await self.fleet.kill_redis()
            away = self.clock()
            dead.calls.append(await self._call(dead.intent, 0))  # nowhere to write it: 503
            await asyncio.sleep(max(0.0, f.hold - (self.clock() - away)))  # sleep-ok: dead
            back = self.clock()
            await self.fleet.restart_redis()  # on its port, empty
            self.outages.append(Outage("redis_kill", away, back))
            dead.calls.append(await self._call(dead.intent, 1))  # the log lost: 503 until healed
            whole = await self._whole(restarts)
        finally:
            stop.set()
            await asyncio.gather(reader, watcher)
        after = await self._states()
        now_logged = self._logged()
        self.losses.append(
            LogLoss(
                at=start,
                restarts=restarts,
                before=tuple(states),
                after=tuple(after),
                losses=tuple(whole[1]),
                flagged=tuple(b - a for a, b in zip(logged[0], now_logged[0], strict=True)),
                healed=now_logged[1] - logged[1],
                healed_after=None if whole[0] is None else whole[0] - back,
                spent_before=max((s for s in spent if s is not None), default=None),
                spent_after=tuple(await self._spent()),
                sampled=tuple(sum(1 for _, r, _ in watched if r == n) for n in range(REPLICAS)),
                drifted=tuple(
                    (t, r, changed)
                    for t, r, state in watched
                    if (changed := drift(states[r], state))
                ),
            )
        )
        problems += await self._finish(before)  # the ids outlived the log: answered as replays
        made_after = [dead, await self._made(self._budget("after_restart", n), 1)]
        problems += await self._settle(made_after)
        problems += await self._finish(made_after)
        if whole[0] is None:
            problems.insert(0, "the log was not whole again on every replica")
        return FaultWindow("redis_kill", None, start, self.clock(), not problems, _say(problems))

    # -- the changes ---------------------------------------------------------------------------

    async def _begin(self) -> int:
        """This phase's number; the first one makes the key whose budget is counted in Redis
        (so that the keys view reads Redis), and spends some of it through every replica."""
        n, self._phases = self._phases, self._phases + 1
        if self.budget_made:
            return n
        answer = await self.fleet.call_admin(
            self.ops,
            0,
            "POST",
            "/admin/keys",
            {"name": BUDGET_KEY, "tokens_per_day": BUDGET},
            within=CALL_S,
        )
        if answer.status != 200 or not isinstance(answer.doc, dict):
            raise RuntimeError(f"the budget key was not made: {answer.status} {answer.doc}")
        self.budget_made = True
        for r in range(REPLICAS):
            await self._spend(r, str(answer.doc["key"]))
        return n

    async def _spend(self, replica: int, secret: str) -> None:
        body = {"model": ALIAS, "messages": [{"role": "user", "content": "count"}], "max_tokens": 8}
        url = f"{self.fleet.gateways[replica].url}/v1/chat/completions"
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with self.ops.post(
                url,
                json=body,
                headers={"Authorization": f"Bearer {secret}"},
                timeout=aiohttp.ClientTimeout(total=READ_S),
            ) as resp:
                await resp.read()

    def _new_key(self, phase: str, n: int, suffix: str = "", *, counted: bool = True) -> Intent:
        name = f"soak-{phase.replace('_', '-')}-{n}{suffix}"
        return Intent(
            f"{name}-made",
            phase,
            "POST",
            "/admin/keys",
            {"name": name},
            lambda s: name in s["keys"],
            counted,
        )

    def _weights(self, phase: str, n: int) -> Intent:
        # Other weights than the policy faults' (loadtest.soak.faults), different every time.
        wanted = {"active": 1.5 + 0.125 * n, "queue": 3.5, "kv": 0.25}
        return Intent(
            f"soak-{phase.replace('_', '-')}-{n}-weights",
            phase,
            "PUT",
            "/admin/policy",
            {"weights": wanted},
            lambda s: s["weights"] == wanted,
        )

    def _budget(self, phase: str, n: int, *, counted: bool = True) -> Intent:
        tokens = BUDGET + 1000 * (n + 1) + (1 if phase == "after_restart" else 0)
        return Intent(
            f"soak-{phase.replace('_', '-')}-{n}-budget",
            phase,
            "PUT",
            f"/admin/keys/{BUDGET_KEY}/budget",
            {"tokens_per_day": tokens},
            lambda s: (
                (s["keys"].get(BUDGET_KEY, {}).get("budget") or {}).get("tokens_per_day") == tokens
            ),
            counted,
        )

    async def _call(self, intent: Intent, through: int, *, after: float = 0.0) -> Call:
        if after:
            await asyncio.sleep(after)  # sleep-ok: a burst's calls a few ms apart
        at = self.clock()
        answer = await self.fleet.call_admin(
            self.ops,
            through,
            intent.method,
            intent.path,
            intent.body,
            key=intent.key,
            within=CALL_S,
        )
        doc = answer.doc if isinstance(answer.doc, dict) else {}
        found = doc.get("error")
        error: dict[str, Any] = found if isinstance(found, dict) else {}
        return Call(
            through=through,
            at=at,
            status=answer.status,
            change_id=answer.headers.get("X-Gateway-Change-Id"),
            state=doc.get("state") if answer.status == 202 else None,
            code=error.get("code"),
            replayed=answer.headers.get("Idempotent-Replayed") == "true",
        )

    async def _made(self, intent: Intent, through: int) -> Made:
        """A change made as an operator would: sent again (the same key) while it is refused
        with a 503 (certainly not written), through the next replica each time."""
        made = Made(intent)
        deadline = time.monotonic() + SETTLE_S
        while True:
            made.calls.append(await self._call(intent, through))
            if made.calls[-1].claim != "not_written" or time.monotonic() > deadline:
                return made
            through = (through + 1) % REPLICAS
            await asyncio.sleep(0.5)  # sleep-ok: an operator's retry, after Retry-After

    async def _fates(self, key: str) -> list[str]:
        out = []
        for r in range(REPLICAS):
            answer = await self.fleet.call_admin(
                self.ops, r, "GET", f"/admin/changes/{key}", within=READ_S
            )
            doc = answer.doc if isinstance(answer.doc, dict) else {}
            out.append(str(doc.get("state")) if answer.status == 200 else f"http {answer.status}")
        return out

    async def _settled(self, key: str) -> list[str]:
        """The fate of ``key`` on every replica, once they all tell the same settled one (or
        what they tell at the deadline)."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            fates = await self._fates(key)
            if (len(set(fates)) == 1 and fates[0] in SETTLED) or time.monotonic() > deadline:
                return fates
            await asyncio.sleep(_POLL_S)  # sleep-ok: polling the replicas with a deadline

    async def _settle(self, made: Sequence[Made]) -> list[str]:
        problems = []
        for m in made:
            m.settled = tuple(await self._settled(m.intent.key))
            if len(set(m.settled)) != 1 or m.settled[0] not in SETTLED:
                problems.append(f"{m.intent.key}: {list(m.settled)}")
        states = await self._states()
        for m in made:
            m.effect_settled = tuple(s is not None and m.intent.shows(s) for s in states)
        return problems

    async def _finish(self, made: Sequence[Made]) -> list[str]:
        """Each change repeated once more, through the replica after the one it last went
        through, and what every replica then says of it."""
        problems = []
        for m in made:
            through = (m.calls[-1].through + 1) % REPLICAS if m.calls else 0
            repeat = await self._call(m.intent, through)
            fates = await self._settled(m.intent.key)
            states = await self._states()
            entries = await self._entries(m.intent.key) if m.intent.counted else None
            change = KeyedChange(
                key=m.intent.key,
                what=m.intent.what,
                phase=m.intent.phase,
                calls=tuple(m.calls),
                settled=m.settled,
                effect_settled=m.effect_settled,
                repeat=repeat,
                fates=tuple(fates),
                effect=tuple(s is not None and m.intent.shows(s) for s in states),
                entries=entries,
            )
            self.changes.append(change)
            if set(fates) != {"applied"}:
                problems.append(f"{m.intent.key} after its repeat: {fates}")
        return problems

    async def _entries(self, key: str) -> int | None:
        answer = await self.fleet.call_admin(
            self.ops, 0, "GET", "/admin/changes?limit=500", within=READ_S
        )
        if answer.status != 200 or not isinstance(answer.doc, dict) or "stale" in answer.doc:
            return None
        return sum(1 for c in answer.doc.get("changes", []) if c.get("id") == key)

    # -- the fleet's state, views and logs -----------------------------------------------------

    async def _part(self, replica: int, path: str) -> dict[str, Any] | None:
        answer = await self.fleet.call_admin(self.ops, replica, "GET", path, within=READ_S)
        ok = answer.status == 200 and isinstance(answer.doc, dict)
        return state_part(path, answer.doc) if ok else None

    async def _state(self, replica: int) -> dict[str, Any] | None:
        """``replica``'s state, its documents read at once (None: one was not 200)."""
        parts = await asyncio.gather(*(self._part(replica, p) for p in STATE_PATHS))
        if any(p is None for p in parts):
            return None
        return {k: v for p in parts if p is not None for k, v in p.items()}

    async def _states(self) -> list[dict[str, Any] | None]:
        return [await self._state(r) for r in range(REPLICAS)]

    async def _watch(
        self, seen: list[tuple[float, int, dict[str, Any] | None]], stop: asyncio.Event
    ) -> None:
        """Every replica's state read again and again until ``stop``: (when, replica, state or
        the part of it one document tells). A replica that passes through another state does
        so for a moment (a Redis round trip): each of its documents is read one after the
        other, besides the whole state every ``WATCH_EVERY_S``."""

        async def whole(replica: int) -> None:
            while not stop.is_set():
                t = self.clock()
                seen.append((t, replica, await self._state(replica)))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), WATCH_EVERY_S)

        async def parts(replica: int) -> None:
            while not stop.is_set():
                for path in STATE_PATHS:
                    t = self.clock()
                    seen.append((t, replica, await self._part(replica, path)))

        await asyncio.gather(*(f(r) for r in range(REPLICAS) for f in (whole, parts)))

    async def _spent(self) -> list[int | None]:
        """The budget key's tokens spent today, as each replica reads it."""
        out: list[int | None] = []
        for r in range(REPLICAS):
            answer = await self.fleet.call_admin(
                self.ops, r, "GET", f"/admin/keys/{BUDGET_KEY}/usage", within=READ_S
            )
            try:
                out.append(int(answer.doc["budget"]["periods"]["day"]["spent"]))
            except (KeyError, TypeError, ValueError):
                out.append(None)
        return out

    async def _whole(self, restarts: int) -> tuple[float | None, list[int | None]]:
        """Wait until every replica says its log is whole (``ok``, the same epoch as the others,
        no problem in the fleet's summary) and counts ``restarts`` losses: when (None: not
        within ``WHOLE_S``), and each replica's ``losses``."""
        deadline = time.monotonic() + WHOLE_S
        while True:
            docs = [
                await self.fleet.call_admin(self.ops, r, "GET", "/admin/replicas", within=READ_S)
                for r in range(REPLICAS)
            ]
            views = [a.doc if a.status == 200 and isinstance(a.doc, dict) else {} for a in docs]
            losses = [v.get("losses") for v in views]
            epochs = {(v.get("summary") or {}).get("epoch") for v in views}
            if (
                all(
                    v.get("log") == "ok"
                    and "stale" not in v
                    and (v.get("summary") or {}).get("log_problems") == {}
                    and isinstance(v.get("losses"), int)
                    and v["losses"] >= restarts
                    for v in views
                )
                and len(epochs) == 1
                and None not in epochs
            ):
                return self.clock(), losses
            if time.monotonic() > deadline:
                return None, losses
            await asyncio.sleep(0.25)  # sleep-ok: polling the replicas with a deadline

    def _logged(self) -> tuple[list[int], int]:
        """``fleet_log_lost`` lines each replica logged so far, and ``fleet_log_healed`` lines
        of them all."""
        lost, healed = [], 0
        for g in self.fleet.gateways:
            events = log_events(g.log_path.read_text(errors="replace"))
            lost.append(count(events, "fleet_log_lost"))
            healed += count(events, "fleet_log_healed")
        return lost, healed

    def _view_paths(self) -> list[str]:
        return [*VIEWS, f"/admin/keys/{BUDGET_KEY}/usage"]

    async def _read(self, replica: int, path: str) -> None:
        start = self.clock()
        answer = await self.fleet.call_admin(self.ops, replica, "GET", path, within=READ_S)
        stale = isinstance(answer.doc, dict) and "stale" in answer.doc
        self.reads.append(ViewRead(replica, path, start, self.clock(), answer.status, stale))

    async def _sweep(self) -> None:
        """Every view of every replica, read at once."""
        await asyncio.gather(
            *(self._read(r, p) for r in range(REPLICAS) for p in self._view_paths())
        )

    async def _read_views(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._sweep()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), READ_EVERY_S)


def _short(body: Any) -> str:
    return "" if body is None else str(body).replace("'", '"')


def _say(problems: Sequence[str]) -> str:
    return "; ".join(problems[:3])
