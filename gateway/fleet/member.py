"""This replica (or worker) as a member of its fleet: it follows the change log, reports
itself to the registry, submits the admin changes its admin API accepts, and compacts the log.

``Member.submit`` appends a change and waits (at most ``wait`` s) until this replica applied
it, then until every replica in the registry reported it applied (``Spread``): the admin API's
answer is this replica's outcome with how far the change reached. A replica reports itself
every ``report_interval`` s and at once after it applied something, so the wait ends as soon
as the last replica applied it.

Started (``start``), a member applies what the log holds before its replica takes traffic,
trying for at most ``start_timeout`` s; Redis still unreachable then, the replica starts on its
file's state and the follower catches up once Redis answers. Stopped, it leaves the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import structlog
from redis.exceptions import RedisError

from backends.errors import FleetLogUnavailable
from gateway.fleet.changes import Change, Position
from gateway.fleet.figures import Figures
from gateway.fleet.follower import Applier, Follower, Outcome
from gateway.fleet.log import ChangeLog
from gateway.fleet.registry import Registry, Report

log = structlog.get_logger("gateway.fleet")

_FAILURES: Final = (RedisError, OSError, TimeoutError)
_POLL_S: Final = 0.02  # how often a submitter reads the registry while replicas catch up


@dataclass(frozen=True, slots=True)
class Spread:
    """How far a change reached within the wait: replicas that applied it, of those alive."""

    applied: int
    replicas: int

    def header(self) -> str:
        return f"{self.applied}/{self.replicas}"


@dataclass(frozen=True, slots=True)
class Submitted:
    position: Position
    outcome: Outcome | None  # None: not applied here within the wait
    spread: Spread


@dataclass(frozen=True, slots=True)
class Description:
    """What a replica says of itself now, in its report."""

    address: str  # where its model endpoints listen (host:port)
    in_flight: dict[str, int]  # per backend id
    health: dict[str, str]  # per backend id: its view
    figures: Figures = field(default_factory=Figures)  # what it served since it started
    driving: dict[str, dict[str, Any]] = field(default_factory=dict)  # rollouts it drives


@dataclass(frozen=True, slots=True)
class MemberSettings:
    fleet: str
    replica: str
    version: str
    wait: float
    report_interval: float
    report_ttl: float
    start_timeout: float
    compact_every: int


def replica_id(configured: str | None, worker: int | None) -> str:
    """This replica's id: the configured one, else host name and process id (a worker's: its
    supervisor's, so a worker started again takes its place); a worker adds its index."""
    if worker is None:
        return configured or f"{socket.gethostname()}-{os.getpid()}"
    return f"{configured or f'{socket.gethostname()}-{os.getppid()}'}/w{worker}"


class Member:
    def __init__(
        self,
        changes: ChangeLog,
        registry: Registry,
        applier: Applier,
        settings: MemberSettings,
        describe: Callable[[], Description],
    ) -> None:
        """``changes`` and ``registry``: the fleet's, on Redis or in files (owned by the
        caller); ``describe``: this replica now (called once per report, never per request)."""
        self.settings = settings
        self.id = settings.replica
        self.changes = changes
        self.follower = Follower(self.changes, applier)
        self.registry = registry
        self._describe = describe
        self._started_at = time.time()
        self._tasks: list[asyncio.Task[None]] = []
        self.reports_failing = False

    # -- life -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Apply what the log holds (bounded), then follow it and report in the background."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.start_timeout
        while True:
            try:
                applied = await self.follower.catch_up()
                log.info("fleet_joined", replica=self.id, applied=applied, at=self._applied())
                break
            except _FAILURES as exc:
                if loop.time() >= deadline:
                    log.warning(
                        "fleet_log_unreachable_at_start",
                        replica=self.id,
                        error=str(exc) or type(exc).__name__,
                        effect="started on the configuration file's state; catches up later",
                    )
                    self.follower.reachable = False
                    break
                await asyncio.sleep(self.follower.retry)  # sleep-ok: retry while Redis is down
        if self.follower.reachable:
            # In the registry before serving: a change made once this replica answers counts
            # it among those that must apply it (the report loop's first turn may come later).
            with contextlib.suppress(*_FAILURES):
                await self.registry.report(self.report())
        self._tasks = [
            asyncio.create_task(self.follower.run(), name="fleet-follower"),
            asyncio.create_task(self._report_loop(), name="fleet-reports"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(*_FAILURES):
            await self.registry.leave(self.id)

    # -- changes --------------------------------------------------------------------------

    async def submit(self, change: Change) -> Submitted:
        """Append ``change``; wait until it is applied here and, within the wait, everywhere."""
        position = await self._appended(change)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.wait
        outcome = await self.follower.reached(position, self.settings.wait)
        spread = await self.spread(position, deadline)
        return Submitted(position, outcome, spread)

    async def append(self, change: Change) -> Outcome | None:
        """Append ``change`` and wait until it is applied here only (None: not within the
        wait): for a change the gateway makes itself, which waits for no other replica."""
        position = await self._appended(change)
        return await self.follower.reached(position, self.settings.wait)

    async def _appended(self, change: Change) -> Position:
        try:
            return await self.changes.append(change)
        except _FAILURES as exc:
            raise FleetLogUnavailable(
                "Admin changes are refused while the fleet's change log cannot be "
                f"reached ({str(exc) or type(exc).__name__}): nothing was changed on any "
                "replica. Requests are still served on the last state applied.",
                retry_after=1,
            ) from exc

    async def spread(self, position: Position, deadline: float) -> Spread:
        """How many replicas applied ``position``, waiting for all of them until ``deadline``."""
        loop = asyncio.get_running_loop()
        seen = Spread(0, 0)
        while True:
            try:
                reports = await self.registry.replicas()
            except _FAILURES:
                return seen
            done = sum(1 for r in reports if r.position is not None and r.position >= position)
            seen = Spread(done, len(reports))
            if done >= len(reports) or loop.time() >= deadline:
                return seen
            await asyncio.sleep(_POLL_S)  # sleep-ok: polls the registry for a bounded wait

    # -- reports and compaction -----------------------------------------------------------

    def _applied(self) -> str | None:
        applied = self.follower.applied
        return None if applied is None else str(applied)

    def report(self) -> Report:
        now = self._describe()
        return Report(
            id=self.id,
            version=self.settings.version,
            address=now.address,
            applied=self._applied(),
            started_at=self._started_at,
            reported_at=time.time(),
            in_flight=now.in_flight,
            health=now.health,
            figures=now.figures,
            driving=now.driving,
        )

    async def _report_loop(self) -> None:
        while True:
            moved = self.follower.advanced
            try:
                await self.registry.report(self.report())
                await self._compact()
                if self.reports_failing:
                    self.reports_failing = False
                    log.info("fleet_reports_resumed", replica=self.id)
            except _FAILURES as exc:
                if not self.reports_failing:
                    self.reports_failing = True
                    log.warning("fleet_reports_failing", error=str(exc) or type(exc).__name__)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(moved.wait(), self.settings.report_interval)

    async def _compact(self) -> None:
        """Past ``compact_every`` entries, make this replica's state the log's snapshot, once
        every replica in the registry has applied as far: one behind would have to start over
        from the snapshot, and the change it was applying would not be answered."""
        length, current = await self.changes.extent()
        if length <= self.settings.compact_every:
            return
        snapshot = await self.follower.snapshot()
        if snapshot is None or (current is not None and snapshot.position <= current):
            return
        others = [r.position for r in await self.registry.replicas() if r.id != self.id]
        if any(p is None or p < snapshot.position for p in others):
            return
        if await self.changes.compact(snapshot, current):
            log.info("fleet_log_compacted", position=str(snapshot.position), entries=length)
