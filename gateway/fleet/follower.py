"""A replica's follower of the change log: it applies every change, in the log's order, once.

The replica that accepted a change applies it here too, not before appending it: every
replica applies the same changes from the same state in the same order, so they end in the
same state, two changes made at once through two replicas included (the log decides which is
last). A change refused where it is applied (it names a backend that is gone) is refused the
same way everywhere, and logged; it changes nothing anywhere.

The follower starts from its replica's last applied position (None at start: from the
snapshot, then everything after it), so a replica that starts, restarts or was cut off applies
what it missed before it goes on; ``catch_up`` is what the replica awaits before it takes
traffic. Redis unreachable: ``run`` logs it once, keeps the state it has, and tries again
every ``retry`` seconds; the first answer brings it up to date.

Every read of the log is judged against the epoch the follower follows
(``gateway.fleet.epoch``): a newer epoch is adopted (the state starts again from its snapshot);
a log lost, replaced by an older one or rewound raises ``LogLost``, which ``run`` hands to the
member's healing (``heal``) and the follower applies nothing meanwhile.

What applying means is the replica's (``Applier``): through its admin handlers, so a change
from the log goes through the same code as one made on a single gateway.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import structlog
from redis.exceptions import RedisError

from gateway.fleet.changes import KEPT_IDS, Batch, Change, Known, Position, Snapshot
from gateway.fleet.epoch import judge, new_epoch
from gateway.fleet.log import ChangeLog

log = structlog.get_logger("gateway.fleet")

_FAILURES: Final = (RedisError, OSError, TimeoutError)
_KEPT_OUTCOMES: Final = 256  # the answers of the last changes applied, for their callers


@dataclass(frozen=True, slots=True)
class ChangeOutcome:
    """What applying a change answered here (the status and body its handler gave)."""

    status: int
    body: bytes

    @property
    def applied(self) -> bool:
        return 200 <= self.status < 300


class LogLost(Exception):
    """The log is not the one this replica followed: gone, an older one, or behind what was
    applied (``gateway.fleet.epoch``). ``seen``: its epoch now (None: none)."""

    def __init__(self, seen: str | None, head: Position | None, known: str | None) -> None:
        super().__init__(f"the fleet's log was lost or rewound (epoch {seen!r}, head {head})")
        self.seen = seen
        self.head = head
        self.known = known


class Applier(Protocol):
    """How a replica applies changes and starts from a snapshot."""

    async def apply(self, position: Position, change: Change) -> ChangeOutcome: ...

    async def restore(self, snapshot: Snapshot) -> None: ...

    def export(self) -> dict[str, Any]:
        """The state every change applied so far has made (a snapshot's)."""
        ...


class Follower:
    def __init__(
        self,
        changes: ChangeLog,
        applier: Applier,
        *,
        block: float = 1.0,
        retry: float = 0.5,
        batch: int = 256,
        heal: Callable[[LogLost], Awaitable[None]] | None = None,
    ) -> None:
        self.changes = changes
        self.applier = applier
        self.block = block
        self.retry = retry
        self.batch = batch
        self.heal = heal
        self.applied: Position | None = None
        self.epoch: str | None = None  # the epoch of the log it follows (None: none yet)
        self.reachable = True  # False while Redis does not answer
        self.lost: LogLost | None = None  # while the log it followed is lost, not yet healed
        self.ids: OrderedDict[str, Known] = OrderedDict()  # the last changes' ids
        self._outcomes: OrderedDict[Position, ChangeOutcome] = OrderedDict()
        self._initial: dict[str, Any] | None = None  # the state before any change
        self._dropping: Position | None = None  # applied before a log was adopted
        self._advanced = asyncio.Event()
        self._lock = asyncio.Lock()  # one catch-up at a time: changes apply once, in order

    async def catch_up(self) -> int:
        """Apply everything the log holds after ``applied``, now; how many changes were.
        Redis errors propagate (``run`` retries; a replica starting fails its start), as does
        ``LogLost``."""
        done = 0
        async with self._lock:
            if self._initial is None:
                self._initial = self.applier.export()
            while True:
                got = await self.changes.after(self.applied, count=self.batch)
                verdict = judge(self.epoch, self.applied, got.epoch, got.head)
                if verdict == "lost":
                    self.lost = LogLost(got.epoch, got.head, self.epoch)
                    raise self.lost
                if verdict == "claim":  # a log from before epochs: given one, kept
                    self.epoch = await self.changes.establish(new_epoch())
                    log.info("fleet_log_epoch_claimed", epoch=self.epoch)
                    continue
                if verdict == "adopt":
                    self._adopt(got.epoch)
                    continue
                self.lost = None
                await self._start(got)
                for position, change in got.entries:
                    outcome = await self._apply(position, change)
                    self._outcomes[position] = outcome
                    while len(self._outcomes) > _KEPT_OUTCOMES:
                        self._outcomes.popitem(last=False)
                    if change.id:
                        self._remember([(change.id, Known(position, change.fingerprint))])
                    self._advance(position)
                    done += 1
                if len(got.entries) < self.batch:
                    return done

    async def _start(self, got: Batch) -> None:
        """The log's snapshot, where this replica is behind it, as its state; after a log was
        adopted, its start (the snapshot, or the state before any change) in any case."""
        if self._dropping is not None and got.snapshot is None:  # adopted, no snapshot
            assert self._initial is not None
            await self.applier.restore(Snapshot(Position(0, 0), self._initial))
        if got.snapshot is not None:
            await self.applier.restore(got.snapshot)
            self._remember(got.snapshot.ids.items())
            log.info("fleet_snapshot_restored", position=str(got.snapshot.position))
            self._advance(got.snapshot.position)
        if self._dropping is not None:  # a log adopted: did it lack what was applied?
            start = None if got.snapshot is None else got.snapshot.position
            if start is None or start < self._dropping:
                log.warning(
                    "fleet_log_adopted_behind",
                    applied_before=str(self._dropping),
                    log_starts_at=None if start is None else str(start),
                    effect="what this replica had applied beyond the adopted log's start is "
                    "gone (it was away while the fleet healed the log)",
                )
            self._dropping = None

    def _adopt(self, epoch: str | None) -> None:
        """Follow the log of ``epoch``: a replica that had followed another starts again from
        this one's snapshot (or, without one, from its state before any change)."""
        assert epoch is not None
        was, applied = self.epoch, self.applied
        self.epoch = epoch
        if was is None and applied is None:
            return  # joining: from the snapshot, as always
        # The state stays as it is until the new log's start replaces it, in the same turn of
        # the event loop as its read (no request or view sees anything in between): its
        # snapshot, or without one the state before any change.
        self.applied = None
        self._outcomes.clear()
        self.ids.clear()  # positions of the old log: the new one's snapshot brings its own
        self._dropping = applied
        log.info(
            "fleet_log_adopted",
            epoch=epoch,
            was=was,
            applied_before=None if applied is None else str(applied),
        )

    def adopt_own(self, epoch: str) -> None:
        """This replica healed the log under ``epoch`` with its own state: nothing to redo."""
        self.epoch = epoch
        self.lost = None

    def _remember(self, pairs: Any) -> None:
        for change_id, known in pairs:
            self.ids[change_id] = known
            self.ids.move_to_end(change_id)
        while len(self.ids) > KEPT_IDS:
            self.ids.popitem(last=False)

    def outcome(self, position: Position) -> ChangeOutcome | None:
        """What applying ``position`` answered here, while it is remembered."""
        return self._outcomes.get(position)

    async def _apply(self, position: Position, change: Change) -> ChangeOutcome:
        try:
            outcome = await self.applier.apply(position, change)
        except Exception as exc:  # one change that breaks must not stop the ones after it
            log.exception("fleet_change_failed", position=str(position), path=change.path)
            return ChangeOutcome(500, f"applying failed: {exc}".encode())
        if outcome.applied:
            log.info(
                "fleet_change_applied",
                position=str(position),
                method=change.method,
                path=change.path,
                replica=change.replica,
            )
        else:
            log.warning(
                "fleet_change_refused",
                position=str(position),
                path=change.path,
                status=outcome.status,
                why=outcome.body[:200].decode(errors="replace"),
            )
        return outcome

    def _advance(self, position: Position) -> None:
        self.applied = position
        self._advanced.set()
        self._advanced = asyncio.Event()

    @property
    def advanced(self) -> asyncio.Event:
        """Set once this replica applies a change after now (a new event each time)."""
        return self._advanced

    async def snapshot(self) -> Snapshot | None:
        """The state as of the last change applied (None before any), between two applies."""
        async with self._lock:
            if self.applied is None:
                return None
            return Snapshot(self.applied, self.applier.export(), dict(self.ids))

    async def run(self) -> None:
        """Follow the log until cancelled."""
        task = asyncio.current_task()
        while True:
            if task is not None and task.cancelling():
                # redis-py (8.2) can swallow a cancellation that lands in a blocking read after
                # it reconnected: the next turn of the loop honours it
                raise asyncio.CancelledError
            try:
                await self.catch_up()
                if not self.reachable:
                    self.reachable = True
                    log.info("fleet_log_reachable", applied=str(self.applied))
                await self.changes.wait(self.applied, self.block)
            except LogLost as lost:
                if self.heal is None:
                    raise
                await self.heal(lost)
            except _FAILURES as exc:
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError from exc  # the cause of the read's failure
                if self.reachable:
                    self.reachable = False
                    log.warning("fleet_log_unreachable", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(self.retry)  # sleep-ok: retry interval while Redis is down

    async def reached(self, position: Position, within: float) -> ChangeOutcome | None:
        """Wait until this replica applied ``position`` (at most ``within`` s); what applying it
        answered (a plain 200 where it came in a snapshot, or so long ago it is forgotten), or
        None if it was not applied in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while self.applied is None or self.applied < position:
            left = deadline - loop.time()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._advanced.wait(), left)
            except TimeoutError:
                return None
        outcome = self._outcomes.get(position)
        if outcome is None:  # in the state, but not applied one by one here
            note = {"position": str(position), "applied": "with the state of the log's snapshot"}
            outcome = ChangeOutcome(200, json.dumps(note).encode())
        return outcome
