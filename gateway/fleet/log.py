"""The fleet's change log: one ordered, durable list of admin changes
(``gateway.fleet.changes``) and the snapshot it is compacted into. ``ChangeLog`` is what a
replica needs of one; ``RedisLog`` keeps it on the Redis the replicas share, and
``gateway.fleet.files.FileLog`` in a directory, for the workers of one host without Redis
(``serve --workers``): one mechanism, two places.

Two Redis keys per fleet, under ``<prefix><fleet>:``:

- ``log``, a Redis Stream: one entry a change, its id the change's position. Redis gives the
  order (``XADD *``), keeps it, and wakes the readers (``XREAD BLOCK``): no ordering of ours.
- ``snapshot``, a hash (``position``, ``state``): the fleet's state once every change up to
  ``position`` was applied. Compacting writes a newer one and trims the log up to its position
  in one script, which refuses unless the snapshot it replaces is the one the compactor started
  from: of two replicas compacting at once one wins, and no entry goes that the snapshot left
  does not cover.

A reader asks for what follows the position it applied (``after``). Snapshot and entries are
read in one transaction, so a compaction between them cannot open a gap; a reader behind the
snapshot (it was away while the log was compacted) gets the snapshot first. Redis errors are
not caught here: the caller decides (an admin change refused with a 503, a follower retrying).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Protocol

from redis.asyncio import Redis

from gateway.fleet.changes import Batch, Change, Position, Snapshot, behind

# KEYS: snapshot, log. ARGV: the position of the snapshot it replaces ('' for none), the new
# snapshot's position, its state, the first position the log keeps.
_COMPACT_LUA: Final = """
local current = redis.call('HGET', KEYS[1], 'position')
if (current or '') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'position', ARGV[2], 'state', ARGV[3])
redis.call('XTRIM', KEYS[2], 'MINID', ARGV[4])
return 1
"""


@dataclass(frozen=True, slots=True)
class LogKeys:
    """The Redis keys of one fleet's log. Replicas that share a Redis and a fleet name are one
    fleet; another name lets a second fleet share the Redis."""

    log: str
    snapshot: str

    @classmethod
    def of(cls, prefix: str, fleet: str) -> LogKeys:
        base = f"{prefix}{fleet}:"
        return cls(log=base + "log", snapshot=base + "snapshot")


class ChangeLog(Protocol):
    """What a replica needs of its fleet's change log. Failures to reach it raise ``OSError``,
    ``TimeoutError`` or Redis's errors; the caller decides (refuse a change, retry)."""

    async def append(self, change: Change) -> Position:
        """Add ``change`` at the end of the log; its position."""
        ...

    async def head(self) -> Position | None:
        """The last change's position (or the snapshot's); None for an empty log."""
        ...

    async def extent(self) -> tuple[int, Position | None]:
        """How many entries the log holds, and its snapshot's position."""
        ...

    async def after(self, applied: Position | None, *, count: int = 256) -> Batch:
        """What follows ``applied``: the snapshot first when ``applied`` is behind it."""
        ...

    async def recent(self, count: int) -> list[tuple[Position, Change]]:
        """The last ``count`` changes, newest first."""
        ...

    async def wait(self, applied: Position | None, block: float) -> bool:
        """Until the log holds something after ``applied`` (at most ``block`` s); whether it
        (probably) does: a spurious True costs the caller one more read."""
        ...

    async def compact(self, snapshot: Snapshot, replaces: Position | None) -> bool:
        """Make ``snapshot`` the log's start unless the stored one is no longer ``replaces``."""
        ...


class RedisLog:
    """One fleet's change log on Redis. ``redis`` is owned by the caller (opened and closed
    there)."""

    def __init__(self, redis: Redis, keys: LogKeys) -> None:
        self.redis = redis
        self.keys = keys
        self._compact = redis.register_script(_COMPACT_LUA)

    async def append(self, change: Change) -> Position:
        """Add ``change`` at the end of the log; its position."""
        fields = change.encode()
        raw = await self.redis.xadd(self.keys.log, fields)  # type: ignore[arg-type]
        return Position.parse(raw)

    async def head(self) -> Position | None:
        """The last change's position (or the snapshot's, when the log was compacted since);
        None for an empty log."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xrevrange(self.keys.log, count=1)
            pipe.hget(self.keys.snapshot, "position")
            last, snapshot_at = await pipe.execute()
        if last:
            return Position.parse(last[0][0])
        return Position.parse(snapshot_at) if snapshot_at else None

    async def extent(self) -> tuple[int, Position | None]:
        """How many entries the log holds, and the position of its snapshot (None: none yet)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xlen(self.keys.log)
            pipe.hget(self.keys.snapshot, "position")
            length, snapshot_at = await pipe.execute()
        return int(length), None if snapshot_at is None else Position.parse(snapshot_at)

    async def after(self, applied: Position | None, *, count: int = 256) -> Batch:
        """What follows ``applied`` (None: nothing applied yet), at most ``count`` entries: the
        snapshot first when ``applied`` is behind it."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hmget(self.keys.snapshot, ["position", "state"])
            start = "-" if applied is None else f"({applied}"
            pipe.xrange(self.keys.log, min=start, max="+", count=count)
            (snapshot_at, state), rows = await pipe.execute()
        snapshot = Snapshot.decode(snapshot_at, state) if snapshot_at is not None else None
        if not behind(snapshot, applied):
            snapshot = None
        floor = snapshot.position if snapshot is not None else applied
        positioned = [(Position.parse(raw), fields) for raw, fields in rows]
        entries = [
            (position, Change.decode(fields))
            for position, fields in positioned
            if floor is None or position > floor
        ]
        return Batch(snapshot, entries)

    async def recent(self, count: int) -> list[tuple[Position, Change]]:
        """The last ``count`` changes, newest first (the audit trail's view)."""
        rows: Any = await self.redis.xrevrange(self.keys.log, count=count)
        return [(Position.parse(raw), Change.decode(fields)) for raw, fields in rows]

    async def wait(self, applied: Position | None, block: float) -> bool:
        """Block until the log holds something after ``applied``, at most ``block`` s (Redis
        ends the wait; the connection's own timeout must be longer); whether it does."""
        start = "0-0" if applied is None else str(applied)
        got = await self.redis.xread({self.keys.log: start}, count=1, block=int(block * 1000))
        return bool(got)

    async def compact(self, snapshot: Snapshot, replaces: Position | None) -> bool:
        """Make ``snapshot`` the log's start and drop the entries it covers, unless the stored
        snapshot is no longer the one at ``replaces`` (another replica compacted first)."""
        done = await self._compact(
            keys=[self.keys.snapshot, self.keys.log],
            args=[
                "" if replaces is None else str(replaces),
                str(snapshot.position),
                snapshot.encode(),
                str(snapshot.position.next()),
            ],
        )
        return bool(done)
