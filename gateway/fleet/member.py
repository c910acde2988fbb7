"""This replica (or worker) as a member of its fleet: it follows the change log, reports
itself to the registry, submits the admin changes its admin API accepts, tells what became of
each, heals a lost log with the others, and compacts the log.

``Member.submit`` appends a change and waits (at most ``wait`` s) until this replica applied
it, then until every replica in the registry reported it applied (``Spread``): the admin API's
answer is this replica's outcome with how far the change reached. A replica reports itself
every ``report_interval`` s and at once after it applied something, so the wait ends as soon
as the last replica applied it.

**Every change has a known fate.** It has an id (``gateway.fleet.changes``); an append is sent
once and either certainly did not reach Redis (``FleetLogUnavailable``, nothing anywhere), or
is in the log, or was sent and not answered within ``log_timeout`` (``Submitted.position``
None: its fate is unknown). An unknown fate is settled as soon as Redis answers
(``gateway.fleet.fates``): the change is in the log, or never will be; ``fates.fate`` tells any
caller which, for any id, on any replica. A repeated call (the same id) finds the change the
first one made (``earlier``) and is answered with its outcome; it never applies it twice.

**A lost log is healed** (``gateway.fleet.epoch``): the follower raises ``LogLost``; this
replica flags it (``fleet_log_lost``, ``losses``, its report), reports what it holds, lets
every replica do the same for a report interval, and the one furthest ahead writes its
state back as the new log's snapshot under a new epoch; the others adopt it. No change goes
into the log meanwhile (``FleetLogLost``).

Started (``start``), a member applies what the log holds before its replica takes traffic,
trying for at most ``start_timeout`` s; Redis still unreachable then, the replica starts on its
file's state and the follower catches up once Redis answers. Stopped, it leaves the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import structlog
from redis.exceptions import RedisError

from backends.errors import FleetLogLost, FleetLogUnavailable, IdempotencyKeyReused
from gateway.fleet.changes import Change, Position, change_id
from gateway.fleet.epoch import leader, new_epoch
from gateway.fleet.fates import Fates
from gateway.fleet.figures import Figures
from gateway.fleet.follower import Applier, ChangeOutcome, Follower, LogLost
from gateway.fleet.log import Appended, ChangeLog, FateUnknown, NotAppended
from gateway.fleet.registry import Registry, Report, applied_by

log = structlog.get_logger("gateway.fleet")

_FAILURES: Final = (RedisError, OSError, TimeoutError)
_POLL_S: Final = 0.02  # how often a submitter reads the registry while replicas catch up
_ATTEMPTS: Final = 3  # appends of one call, while a look at its fate fences it meanwhile


@dataclass(frozen=True, slots=True)
class Spread:
    """How far a change reached within the wait: replicas that applied it, of those alive."""

    applied: int
    replicas: int

    def header(self) -> str:
        return f"{self.applied}/{self.replicas}"


@dataclass(frozen=True, slots=True)
class Submitted:
    """What became of a submitted change, as far as known when answering. ``position`` None:
    sent, no answer from Redis (its fate is unknown until ``Member.fate`` tells)."""

    id: str
    position: Position | None
    outcome: ChangeOutcome | None  # None: not applied here within the wait
    spread: Spread
    replayed: bool = False  # an earlier call with the same id made it


@dataclass(frozen=True, slots=True)
class Description:
    """What a replica says of itself now, in its report."""

    address: str  # where its model endpoints listen (host:port)
    in_flight: dict[str, int]  # per backend id
    health: dict[str, str]  # per backend id: its view
    figures: Figures = field(default_factory=Figures)  # what it served since it started
    driving: dict[str, dict[str, Any]] = field(default_factory=dict)  # rollouts it drives
    held: dict[str, int] = field(default_factory=dict)  # requests held for a wake, per model
    capacity: dict[str, Any] = field(default_factory=dict)  # its last look, if it manages


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
    log_timeout: float = 2.0


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
        *,
        on_new_epoch: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``changes`` and ``registry``: the fleet's, on Redis or in files (owned by the
        caller); ``describe``: this replica now (called once per report, never per request);
        ``on_new_epoch``: after the log was healed or a healed one adopted (the budgets' counts
        written back)."""
        self.settings = settings
        self.id = settings.replica
        self.changes = changes
        self.follower = Follower(self.changes, applier, heal=self._heal)
        self.registry = registry
        self._describe = describe
        self._on_new_epoch = on_new_epoch
        self._started_at = time.time()
        self._tasks: list[asyncio.Task[None]] = []
        self.reports_failing = False
        self.losses = 0  # lost logs seen (metrics)
        self.heals = 0  # lost logs this replica healed
        self.lost_since: float | None = None  # while the log is lost (Unix time)
        self._epoch_seen: str | None = None  # the epoch the hook last ran for
        self.fates = Fates(changes, self.follower, settings.log_timeout)
        self._healing_since: float | None = None  # loop time of this healing's first turn

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
            except LogLost as lost:
                if loop.time() >= deadline:
                    log.warning(
                        "fleet_log_lost_at_start",
                        replica=self.id,
                        effect="started on the configuration file's state; joins the log "
                        "once it is healed",
                    )
                    break
                await self._heal(lost)
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
        self._epoch_seen = self.follower.epoch
        if self.follower.reachable:
            # In the registry before serving: a change made once this replica answers counts
            # it among those that must apply it (the report loop's first turn may come later).
            with contextlib.suppress(*_FAILURES):
                await self.registry.report(self.report())
        self._tasks = [
            asyncio.create_task(self.follower.run(), name="fleet-follower"),
            asyncio.create_task(self._report_loop(), name="fleet-reports"),
            asyncio.create_task(self.fates.run(), name="fleet-fates"),
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

    async def ready(
        self, change_id: str, fingerprint: str, *, repeat: bool
    ) -> tuple[Submitted | None, bool]:
        """Before a change is checked: with ``repeat`` (the caller named its id), the change an
        earlier call with that id made, answered as ``submit`` answers (``IdempotencyKeyReused``
        if it was another request); else None, and this replica brought up to the log's head
        (the second part: whether it was), so the change is checked against the latest state.
        Both within half a ``log_timeout``: Redis slow or away, neither (the append tells what
        it can); ``FleetLogLost`` while the log is being healed."""
        known = self.fates.local(change_id)
        current = False
        try:
            async with asyncio.timeout(self.settings.log_timeout / 2):
                if repeat and known is None:
                    known = (await self.changes.find(change_id)).known
                if known is None:
                    await self.follower.catch_up()
                    current = True
        except LogLost as exc:
            raise _lost() from exc
        except _FAILURES:
            pass
        if known is None or not repeat:
            return None, current
        return await self._answered(change_id, Appended(known, new=False), fingerprint), current

    async def submit(self, change: Change) -> Submitted:
        """Append ``change``; wait until it is applied here and, within the wait, everywhere.
        ``FleetLogUnavailable`` (or ``FleetLogLost``) when it certainly is not in the log."""
        change = _with_id(change)
        appended = await self._appended(change)
        if appended is None:
            return Submitted(change.id, None, None, Spread(0, 0))
        return await self._answered(change.id, appended, change.fingerprint)

    async def append(self, change: Change) -> ChangeOutcome | None:
        """Append ``change`` and wait until it is applied here only (None: not within the
        wait, or its fate unknown): for a change the gateway makes itself, which waits for no
        other replica."""
        appended = await self._appended(_with_id(change))
        if appended is None:
            return None
        return await self.follower.reached(appended.position, self.settings.wait)

    async def _answered(self, change_id: str, appended: Appended, fingerprint: str) -> Submitted:
        if not appended.new and appended.known.fingerprint != fingerprint:
            raise IdempotencyKeyReused(
                f"Idempotency-Key {change_id!r} was used for another request (change "
                f"{appended.position}); use a new key for a new change.",
                param="Idempotency-Key",
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.wait
        outcome = await self.follower.reached(appended.position, self.settings.wait)
        spread = await self.spread(appended.position, deadline)
        return Submitted(change_id, appended.position, outcome, spread, not appended.new)

    async def _appended(self, change: Change) -> Appended | None:
        """In the log (``Appended``), or None: sent, fate unknown. Raises when certainly not."""
        epoch = self.follower.epoch
        if self.follower.lost is not None:
            raise _lost()
        if epoch is None:  # started while Redis was away, not joined yet
            raise _unavailable("this replica has not read it since it started")
        attempt = 0
        for _ in range(_ATTEMPTS):
            try:
                got = await self.changes.append(change, epoch=epoch, attempt=attempt)
            except NotAppended as exc:
                raise _unavailable(str(exc)) from exc
            except FateUnknown as exc:
                self.fates.unknown(change, str(exc))
                return None
            except _FAILURES as exc:
                raise _unavailable(str(exc) or type(exc).__name__) from exc
            if isinstance(got, Appended):
                return got
            if got.fenced is None:
                raise _lost()
            attempt = got.fenced  # a look at its fate fenced it meanwhile: a new attempt
        raise _unavailable("its id was fenced at every attempt")

    @property
    def unknown(self) -> int:
        """Changes submitted here whose fate is not known yet (metrics)."""
        return self.fates.pending

    async def spread(self, position: Position, deadline: float) -> Spread:
        """How many replicas applied ``position``, waiting for all of them until ``deadline``."""
        loop = asyncio.get_running_loop()
        seen = Spread(0, 0)
        epoch = self.follower.epoch
        while True:
            try:
                reports = await self.registry.replicas()
            except _FAILURES:
                return seen
            done = applied_by(((r.applied, r.epoch) for r in reports), position, epoch)
            seen = Spread(done, len(reports))
            if done >= len(reports) or loop.time() >= deadline:
                return seen
            await asyncio.sleep(_POLL_S)  # sleep-ok: polls the registry for a bounded wait

    # -- a lost log -------------------------------------------------------------------------

    async def _heal(self, lost: LogLost) -> None:
        """One turn of healing (the follower calls it again until the log is whole): say what
        this replica holds, let the others say it too, and write the log anew if this replica
        is the one furthest ahead."""
        if lost.known is None and self.follower.applied is None:
            log.info("fleet_log_starting", replica=self.id, effect="a log is given its epoch")
        elif self.lost_since is None:
            self.lost_since = time.time()
            self.losses += 1
            log.warning(
                "fleet_log_lost",
                replica=self.id,
                epoch_followed=lost.known,
                epoch_found=lost.seen,
                head=None if lost.head is None else str(lost.head),
                applied=self._applied(),
                effect="admin changes are refused until the replica furthest ahead writes its "
                "state back as the log's new start",
            )
        with contextlib.suppress(*_FAILURES):
            await self.registry.report(self.report())
        loop = asyncio.get_running_loop()
        # Every replica alive reports within an interval (the ones that noticed it, at once);
        # then the leader writes the log at once: the others look again after a retry, until
        # a few intervals have passed without it (it died: another is chosen).
        settle = self.settings.report_interval + self.follower.retry
        waiting = self._healing_since is not None and loop.time() - self._healing_since < 3 * settle
        if not waiting:
            self._healing_since = loop.time()
        pause = self.follower.retry if waiting else settle
        await asyncio.sleep(pause)  # sleep-ok: the replicas' reports, or the leader's write
        try:
            reports = await self.registry.replicas()
        except _FAILURES:
            return
        standings = [(r.id, r.epoch, r.position) for r in reports if r.id != self.id]
        standings.append((self.id, self.follower.epoch, self.follower.applied))
        if leader(standings) != self.id:
            return
        epoch = new_epoch()
        snapshot = await self.follower.snapshot()
        try:
            healed = await self.changes.heal(lost.seen, epoch, snapshot)
        except _FAILURES:
            return
        if healed and lost.known is None and snapshot is None:  # nothing to write back
            self.follower.adopt_own(epoch)
            log.info("fleet_log_started", replica=self.id, epoch=epoch, replicas=len(standings))
        elif healed:
            self.heals += 1
            self.follower.adopt_own(epoch)
            log.warning(
                "fleet_log_healed",
                replica=self.id,
                epoch=epoch,
                position=None if snapshot is None else str(snapshot.position),
                replicas=len(standings),
            )

    async def _after_epoch_change(self) -> None:
        epoch = self.follower.epoch
        if self.follower.lost is None:
            self._healing_since = None
        if self.follower.lost is None and self.lost_since is not None:
            log.info(
                "fleet_log_whole",
                replica=self.id,
                epoch=epoch,
                after_s=round(time.time() - self.lost_since, 3),
            )
            self.lost_since = None
        if epoch is None or epoch == self._epoch_seen:
            return
        first = self._epoch_seen is None
        self._epoch_seen = epoch
        if not first and self._on_new_epoch is not None:
            await self._on_new_epoch()

    # -- reports and compaction -----------------------------------------------------------

    def _applied(self) -> str | None:
        applied = self.follower.applied
        return None if applied is None else str(applied)

    def log_state(self) -> str:
        """``ok``, ``lost`` (being healed) or ``unreachable``, as this replica sees its log."""
        if self.follower.lost is not None or self.lost_since is not None:
            return "lost"
        return "ok" if self.follower.reachable else "unreachable"

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
            held=now.held,
            capacity=now.capacity,
            epoch=self.follower.epoch,
            log=self.log_state(),
        )

    async def _report_loop(self) -> None:
        while True:
            moved = self.follower.advanced
            try:
                await self._after_epoch_change()
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
        from the snapshot, and the change it was applying would not be answered. Never while
        the log is lost."""
        if self.follower.lost is not None or self.follower.epoch is None:
            return
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


def _with_id(change: Change) -> Change:
    return change if change.id else dataclasses.replace(change, id=change_id(None))


def _lost() -> FleetLogLost:
    return FleetLogLost(
        "Admin changes are refused while the fleet's change log is being healed (Redis lost "
        "it, or an older copy came back): nothing was changed on any replica. The replica "
        "furthest ahead writes its state back within a few report intervals; "
        "GET /admin/replicas shows where it stands.",
        retry_after=2,
    )


def _unavailable(why: str) -> FleetLogUnavailable:
    return FleetLogUnavailable(
        "Admin changes are refused while the fleet's change log cannot be reached "
        f"({why}): the change was not written, nothing was changed on any replica. "
        "Requests are still served on the last state applied.",
        retry_after=1,
    )
