"""The log's identity (its epoch) and what a replica makes of the log it finds. Pure.

A replica remembers the epoch of the log it follows and how far it applied it. A Redis restarted
empty (no persistence, a new volume) loses the log and its epoch; one restored from an older
copy holds an older epoch, or the same epoch behind what the replicas applied. Applied as is,
such a log splits the fleet: a replica that starts again rebuilds its state from what the log
still holds (its file's state and little else), while those running keep theirs. So a replica
judges every read of the log (``judge``):

- ``ok``: the epoch it follows, at or past what it applied;
- ``adopt``: a newer epoch (another replica healed the log) or, for a replica that has none yet,
  the epoch in force: it starts again from that log (its snapshot, then what follows);
- ``lost``: no epoch, an older one, or its own epoch behind what it applied: the log must be
  healed before any change goes into it (changes are refused meanwhile);
- ``claim``: no epoch but a log written before epochs existed: the first replica to look
  gives it one, keeping it.

Healing follows one rule every replica applies alike (``leader``): once every replica alive
had a report interval to say what it holds, the one furthest ahead (the newest epoch, then the
furthest position, then the smallest id) writes its state back as the new log's snapshot under
a new epoch; the others adopt it. A brand-new fleet is the same case with nothing applied
anywhere: the leader writes an epoch and no state.

An epoch is ``<ms>-<random>``: the time it was made, so that newer ones sort after older ones.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Literal

from gateway.fleet.changes import Position

EpochVerdict = Literal["ok", "adopt", "lost", "claim"]


def new_epoch(now: float | None = None) -> str:
    ms = int((time.time() if now is None else now) * 1000)
    return f"{ms:013d}-{secrets.token_hex(4)}"


def newer(epoch: str | None, than: str | None) -> bool:
    """Whether ``epoch`` was made after ``than`` (any epoch is newer than none)."""
    if epoch is None:
        return False
    return than is None or epoch > than


def judge(
    known: str | None,
    applied: Position | None,
    seen: str | None,
    head: Position | None,
) -> EpochVerdict:
    """What a replica that follows ``known`` and applied up to ``applied`` makes of a log whose
    epoch is ``seen`` and whose head is ``head`` (None: it holds nothing)."""
    if seen is None:
        if known is None and applied is None and head is not None:
            return "claim"
        return "lost"
    if known is None or newer(seen, known):
        return "adopt"
    if seen != known:
        return "lost"  # an older log put back
    if applied is not None and (head is None or head < applied):
        return "lost"  # rewound: it lacks what was applied
    return "ok"


Standing = tuple[str, str | None, Position | None]  # replica id, its epoch, applied


def leader(standings: Sequence[Standing]) -> str | None:
    """The replica that heals a lost log: the newest epoch, then the furthest applied, then
    the smallest id. None for nobody."""
    if not standings:
        return None

    def rank(s: Standing) -> tuple[str, Position]:
        _, epoch, applied = s
        return (epoch or "", applied if applied is not None else Position(-1, 0))

    best = max(rank(s) for s in standings)
    return min(s[0] for s in standings if rank(s) == best)
