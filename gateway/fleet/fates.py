"""What became of each admin change, as this replica knows it (``Member.fates``).

A change is in the log or not, for good, once its id is *fenced* (``ChangeLog.fence``): an
append still on its way is refused from then on. The changes submitted here whose fate is
unknown (sent, no answer from Redis: ``FateUnknown``) are fenced as soon as Redis answers
(``run``), each said in the log (``fleet_change_fate_known``); ``fate`` tells any caller about
any id, from what this replica applied, what it settled, or a fence of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final, Literal

import structlog
from redis.exceptions import RedisError

from gateway.fleet.changes import Change, Known, Position
from gateway.fleet.follower import ChangeOutcome, Follower
from gateway.fleet.log import ChangeLog

log = structlog.get_logger("gateway.fleet")

_FAILURES: Final = (RedisError, OSError, TimeoutError)
_KEPT: Final = 1024  # the fates of changes submitted here, once known (and those unknown)

FateState = Literal["applied", "refused", "pending", "not_applied", "unknown"]


@dataclass(frozen=True, slots=True)
class Fate:
    """What became of a change, as this replica knows it: ``applied`` (here, by its handler),
    ``refused`` (in the log, refused by its handler here, and so everywhere), ``pending`` (in
    the log, not applied here yet), ``not_applied`` (never in the log, and never will be),
    ``unknown`` (Redis does not answer)."""

    id: str
    state: FateState
    position: Position | None = None
    outcome: ChangeOutcome | None = None


class Fates:
    def __init__(self, changes: ChangeLog, follower: Follower, timeout: float) -> None:
        """``timeout``: how long a fence waits for Redis."""
        self.changes = changes
        self.follower = follower
        self.timeout = timeout
        self._unknown: OrderedDict[str, float] = OrderedDict()  # ids of unknown fate, since
        self._settled: OrderedDict[str, Known | None] = OrderedDict()  # None: not applied
        self._unsettled = asyncio.Event()

    def local(self, change_id: str) -> Known | None:
        """Where ``change_id`` is in the log, as this replica knows without asking Redis."""
        return self.follower.ids.get(change_id) or self._settled.get(change_id)

    def unknown(self, change: Change, why: str) -> None:
        """``change`` was sent and not answered: settled as soon as Redis answers."""
        self._unknown[change.id] = time.time()
        while len(self._unknown) > _KEPT:  # never settled: the oldest forgotten
            self._unknown.popitem(last=False)
        self._unsettled.set()
        log.warning("fleet_change_fate_unknown", id=change.id, path=change.path, error=why)

    @property
    def pending(self) -> int:
        """Changes submitted here whose fate is not known yet."""
        return len(self._unknown)

    async def fate(self, change_id: str) -> Fate:
        """What became of ``change_id``, for good where Redis answers (an id never seen is
        fenced: it can no longer arrive, so it is ``not_applied``)."""
        known = self.local(change_id)
        if known is None and change_id in self._settled:
            return Fate(change_id, "not_applied")
        if known is None:
            try:
                known = await self._fence(change_id)
            except _FAILURES:
                return Fate(change_id, "unknown")
            if known is None:
                return Fate(change_id, "not_applied")
        applied = self.follower.applied
        if applied is None or applied < known.position:
            return Fate(change_id, "pending", known.position)
        outcome = self.follower.outcome(known.position)
        state: FateState = "refused" if outcome is not None and not outcome.applied else "applied"
        return Fate(change_id, state, known.position, outcome)

    async def _fence(self, change_id: str) -> Known | None:
        state = await asyncio.wait_for(self.changes.fence(change_id), self.timeout)
        if self._unknown.pop(change_id, None) is not None:
            log.info(
                "fleet_change_fate_known",
                id=change_id,
                state="in the log" if state.known is not None else "not applied",
                position=None if state.known is None else str(state.known.position),
            )
        self._settled[change_id] = state.known
        while len(self._settled) > _KEPT:
            self._settled.popitem(last=False)
        return state.known

    async def run(self) -> None:
        """Each change of unknown fate fenced as soon as Redis answers: in the log, or never."""
        while True:
            await self._unsettled.wait()
            self._unsettled.clear()
            while self._unknown:
                try:
                    await self._fence(next(iter(self._unknown)))
                except _FAILURES:
                    await asyncio.sleep(self.follower.retry)  # sleep-ok: Redis still away
