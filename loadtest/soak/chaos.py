"""Fires the planned faults at their times and records each as a ``FaultWindow``.

Faults run one after the other, each to its end (restarted, reverted, recovered on both
replicas): a fault that overruns delays the next rather than overlapping it, so one backend at
most is ever faulty. What a fault could not do (an admin call refused, a backend not back in
time) is recorded in its window, and the ``faults_injected`` invariant fails on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import aiohttp

from loadtest.soak import prom
from loadtest.soak.client import limits_probe
from loadtest.soak.config import ALIAS
from loadtest.soak.faults import FaultWindow, PlannedFault
from loadtest.soak.fleet import REPLICAS, Fleet
from loadtest.soak.invariants import AdminChange, LimitsProbe
from loadtest.soak.mix import PROBED_KEY
from loadtest.soak.outcomes import Observation
from loadtest.soak.redis_faults import RedisFaults

RECOVERY_S: Final = 20.0  # a restarted or reverted backend must be up on both replicas by then
CHANGE_WITHIN_S: Final = 5.0  # an admin change must be seen on every replica by then
Clock = Callable[[], float]


@dataclass(slots=True)
class Chaos:
    fleet: Fleet
    ops: aiohttp.ClientSession  # admin calls, scrapes
    load: aiohttp.ClientSession  # the limits probe's requests
    clock: Clock
    t0: float  # time.monotonic() of the load's start
    rpm: int  # the probed key's requests per minute
    redis: RedisFaults  # Redis paused, and restarted empty, with admin changes around
    windows: list[FaultWindow] = field(default_factory=list)
    probes: list[LimitsProbe] = field(default_factory=list)
    probe_observations: list[Observation] = field(default_factory=list)
    probing: bool = False  # the limits probe is running now
    changes: list[AdminChange] = field(default_factory=list)  # admin changes, in order
    _before_shift: dict[str, float] | None = None  # the alias's weights a rollback restores

    async def run(self, plan: Sequence[PlannedFault]) -> None:
        for f in plan:
            delay = self.t0 + f.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # sleep-ok: a fault's scheduled time
            try:
                window = await self.fire(f)
            except (aiohttp.ClientError, OSError, RuntimeError, TimeoutError) as exc:
                now = self.clock()
                window = FaultWindow(
                    f.kind, f.target, now, now, False, f"{type(exc).__name__}: {exc}"
                )
            self.windows.append(window)

    async def fire(self, f: PlannedFault) -> FaultWindow:
        handlers: dict[str, Callable[[PlannedFault], Awaitable[FaultWindow]]] = {
            "kill": self._kill,
            "hang": self._held,
            "down": self._held,
            "error_burst": self._error_burst,
            "redis_kill": self.redis.restart_empty,
            "redis_pause": self.redis.pause,
            "reload": self._reload,
            "policy": self._policy,
            "canary_shift": self._canary_shift,
            "canary_rollback": self._canary_rollback,
            "limits_probe": self._limits_probe,
        }
        return await handlers[f.kind](f)

    async def _up_everywhere(self, name: str) -> bool:
        ups = await asyncio.gather(
            *(self.fleet.wait_backends(self.ops, r, {name}, RECOVERY_S) for r in range(REPLICAS))
        )
        return all(ups)

    async def _kill(self, f: PlannedFault) -> FaultWindow:
        assert f.target is not None
        await self.fleet.kill_sim(self.ops, f.target)
        start = self.clock()
        await asyncio.sleep(f.hold)  # sleep-ok: the backend stays dead this long
        await self.fleet.restart_sim(f.target)
        ok = await self._up_everywhere(f.target)
        return FaultWindow("kill", f.target, start, self.clock(), ok, "" if ok else "not back up")

    async def _held(self, f: PlannedFault) -> FaultWindow:
        """Faults switched on for ``hold`` seconds, then off (a hang, a backend marked down)."""
        assert f.target is not None
        await self.fleet.put_sim_faults(self.ops, f.target, dict(f.params))
        start = self.clock()
        await asyncio.sleep(f.hold)  # sleep-ok: the fault stays on this long
        off = dict.fromkeys(f.params, False)
        await self.fleet.put_sim_faults(self.ops, f.target, off)
        ok = await self._up_everywhere(f.target)
        return FaultWindow(f.kind, f.target, start, self.clock(), ok, "" if ok else "not back up")

    async def _error_burst(self, f: PlannedFault) -> FaultWindow:
        assert f.target is not None
        patch = {**f.params, "revert_after": f.hold}
        await self.fleet.put_sim_faults(self.ops, f.target, patch)
        start = self.clock()
        await asyncio.sleep(f.hold)  # sleep-ok: the simulator reverts the burst itself
        deadline = time.monotonic() + 5.0
        reverted = False
        while not reverted and time.monotonic() < deadline:
            faults = await self.fleet.sim_faults(self.ops, f.target)
            reverted = faults is not None and faults.get("error_rate") == 0.0
            if not reverted:
                await asyncio.sleep(0.05)  # sleep-ok: polling the revert with a deadline
        detail = "" if reverted else "revert_after did not revert"
        return FaultWindow("error_burst", f.target, start, self.clock(), reverted, detail)

    async def _through_one(
        self,
        kind: str,
        change: tuple[str, str, object],
        read: str,
        check: Callable[[Any], bool],
    ) -> tuple[bool, str]:
        """Make an admin change through one replica (each change the next one in turn), as an
        operator behind a load balancer does, then read ``read`` on every replica until
        ``check`` holds there: recorded for the ``admin_changes_everywhere`` invariant."""
        through = len(self.changes) % REPLICAS
        method, path, body = change
        status, _doc, spread = await self.fleet.admin_change(self.ops, through, method, path, body)
        applied: list[int] = []
        deadline = time.monotonic() + CHANGE_WITHIN_S
        for r in range(REPLICAS):
            while True:
                got, doc = await self.fleet.admin(self.ops, r, "GET", read)
                if got == 200 and check(doc):
                    applied.append(r)
                    break
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)  # sleep-ok: polling a replica's state with a deadline
        record = AdminChange(kind, through, status, spread, applied, REPLICAS)
        self.changes.append(record)
        return record.ok, record.problem

    async def _reload(self, f: PlannedFault) -> FaultWindow:
        start = self.clock()
        aliases = f.params["aliases"]
        self.fleet.write_configs(aliases=aliases)
        ok, detail = await self._through_one(
            "reload",
            ("POST", "/admin/reload", None),
            f"/admin/aliases/{ALIAS}",
            lambda d: d.get("weights") == _floats(aliases[ALIAS]),
        )
        return FaultWindow("reload", None, start, self.clock(), ok, detail)

    async def _policy(self, f: PlannedFault) -> FaultWindow:
        start = self.clock()
        wanted = f.params["policy"]
        ok, detail = await self._through_one(
            "policy",
            ("PUT", "/admin/policy", dict(f.params)),
            "/admin/policy",
            lambda d: d.get("policy") == wanted,
        )
        return FaultWindow("policy", wanted, start, self.clock(), ok, detail)

    async def _canary_shift(self, f: PlannedFault) -> FaultWindow:
        start = self.clock()
        weights = f.params[ALIAS]
        status, doc = await self.fleet.admin(self.ops, 0, "GET", f"/admin/aliases/{ALIAS}")
        self._before_shift = doc.get("weights") if status == 200 and isinstance(doc, dict) else None
        ok, detail = await self._through_one(
            "canary_shift",
            ("PUT", f"/admin/aliases/{ALIAS}", dict(weights)),
            f"/admin/aliases/{ALIAS}",
            lambda d: d.get("weights") == _floats(weights),
        )
        return FaultWindow("canary_shift", None, start, self.clock(), ok, detail)

    async def _canary_rollback(self, f: PlannedFault) -> FaultWindow:
        start = self.clock()
        ok, detail = await self._through_one(
            "canary_rollback",
            ("POST", f"/admin/aliases/{ALIAS}/rollback", None),
            f"/admin/aliases/{ALIAS}",
            lambda d: self._before_shift is not None and d.get("weights") == self._before_shift,
        )
        return FaultWindow("canary_rollback", None, start, self.clock(), ok, detail)

    async def _limits_probe(self, f: PlannedFault) -> FaultWindow:
        start = self.clock()
        if self.fleet.redis is None:  # fail-open admits without limits: nothing to measure
            return FaultWindow("limits_probe", None, start, start, False, "Redis was down")
        self.probing = True
        try:
            before = await self._degraded(f"key:{PROBED_KEY}")
            probe, seen = await limits_probe(
                self.load, self.fleet.urls, at=start, rpm=self.rpm, clock=self.clock
            )
            after = await self._degraded(f"key:{PROBED_KEY}")
        finally:
            self.probing = False
        if before is not None and after is not None:
            probe = replace(probe, degraded=int(after - before))
        self.probes.append(probe)
        self.probe_observations += seen
        return FaultWindow("limits_probe", None, start, self.clock())

    async def _degraded(self, key: str) -> float | None:
        """``key``'s admissions let through unchecked, summed over the replicas (None: a
        replica did not answer its scrape)."""
        pages = await asyncio.gather(
            *(self.fleet.gateway_metrics(self.ops, r) for r in range(REPLICAS))
        )
        if any(p is None for p in pages):
            return None
        name = "llm_gateway_limits_degraded_admissions_total"
        return sum(prom.total(prom.samples(p), name, key=key) for p in pages if p is not None)


def _floats(weights: Any) -> dict[str, float]:
    return {str(k): float(v) for k, v in dict(weights).items()}
