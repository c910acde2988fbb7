"""The fleet's change log: one ordered, durable list of admin changes
(``gateway.fleet.changes``) and the snapshot it is compacted into. ``ChangeLog`` is what a
replica needs of one; ``RedisLog`` keeps it on the Redis the replicas share, and
``gateway.fleet.files.FileLog`` in a directory, for the workers of one host without Redis
(``serve --workers``): one mechanism, two places.

Keys per fleet, under ``<prefix><fleet>:``:

- ``log``, a Redis Stream: one entry a change, its id the change's position. Redis gives the
  order (``XADD *``), keeps it, and wakes the readers (``XREAD BLOCK``): no ordering of ours.
- ``snapshot``, a hash (``position``, ``state``, ``ids``): the fleet's state once every change up
  to ``position`` was applied. Compacting writes a newer one and trims the log up to its
  position in one script, which refuses unless the snapshot it replaces is the one the
  compactor started from: of two replicas compacting at once one wins, and no entry goes that
  the snapshot left does not cover.
- ``epoch``: the log's identity (``gateway.fleet.epoch``). An append names the epoch its
  replica follows and is refused under another (or none): a lost log takes no change until it
  is healed (``heal``: the new epoch and the snapshot that starts it, in one script).
- ``id:<id>``, one a change id, for a day: ``p:<position>:<fingerprint>`` once the change is in
  the log, or ``g:<n>`` once a look at its fate (``fence``) found it absent: an append still on
  its way (sent before a timeout, held in a paused Redis's socket) names the generation it
  expects (``attempt``, 0 at first) and is refused once fenced, so "not in the log" stays true.

A reader asks for what follows the position it applied (``after``). Snapshot and entries are
read in one transaction, so a compaction between them cannot open a gap; a reader behind the
snapshot (it was away while the log was compacted) gets the snapshot first.

Failures: an append is sent once, on a connection of its own (never retried by the client),
and says whether it certainly did not reach Redis (``NotAppended``: no connection) or may have
(``FateUnknown``: sent, no answer). Other calls raise Redis's errors, ``OSError`` or
``TimeoutError``: the caller decides (a view answered from the last state known, a follower
retrying).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Final, Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from gateway.fleet.changes import Batch, Change, Known, Position, Snapshot, behind

ID_TTL_MS: Final = 86_400_000  # how long a change id (an Idempotency-Key) is remembered

# KEYS: snapshot, log. ARGV: the position of the snapshot it replaces ('' for none), the new
# snapshot's position, its state, the first position the log keeps, its ids.
_COMPACT_LUA: Final = """
local current = redis.call('HGET', KEYS[1], 'position')
if (current or '') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'position', ARGV[2], 'state', ARGV[3], 'ids', ARGV[5])
redis.call('XTRIM', KEYS[2], 'MINID', ARGV[4])
return 1
"""

# KEYS: epoch, id, log. ARGV: the epoch expected, the attempt's generation, the id's TTL (ms),
# the entry, the request's fingerprint. {'new', position} | {'dup', 'position:fp'} |
# {'fenced', generation} | {'epoch', the epoch in force or ''}.
_APPEND_LUA: Final = """
local epoch = redis.call('GET', KEYS[1])
if epoch ~= ARGV[1] then return {'epoch', epoch or ''} end
local cur = redis.call('GET', KEYS[2])
if cur then
  if string.sub(cur, 1, 2) == 'p:' then return {'dup', string.sub(cur, 3)} end
  if cur ~= 'g:' .. ARGV[2] then return {'fenced', string.sub(cur, 3)} end
end
local pos = redis.call('XADD', KEYS[3], '*', 'change', ARGV[4])
redis.call('SET', KEYS[2], 'p:' .. pos .. ':' .. ARGV[5], 'PX', ARGV[3])
return {'new', pos}
"""

# KEYS: id. ARGV: its TTL (ms). 'p:position:fp' if the change is in the log, else the id's
# new generation 'g:<n>': an append of an older one is refused from now on.
_FENCE_LUA: Final = """
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, 2) == 'p:' then return cur end
local n = 0
if cur then n = tonumber(string.sub(cur, 3)) or 0 end
redis.call('SET', KEYS[1], 'g:' .. (n + 1), 'PX', ARGV[1])
return 'g:' .. (n + 1)
"""

# KEYS: epoch, snapshot, log, then one key per id. ARGV: the epoch seen ('' for none), the new
# epoch, the snapshot's position ('' for none), its state, its ids, the ids' TTL (ms), then
# each id's 'position:fp'. 1 if healed, 0 if the epoch is no longer the one seen.
_HEAL_LUA: Final = """
if (redis.call('GET', KEYS[1]) or '') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[2], KEYS[3])
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[2], 'position', ARGV[3], 'state', ARGV[4], 'ids', ARGV[5])
  redis.call('XADD', KEYS[3], ARGV[3], 'healed', ARGV[2])
  redis.call('XDEL', KEYS[3], ARGV[3])
  for i = 4, #KEYS do
    redis.call('SET', KEYS[i], 'p:' .. ARGV[i + 3], 'PX', ARGV[6])
  end
end
return 1
"""


class NotAppended(Exception):
    """The append certainly did not reach the log (no connection to Redis was made)."""


class FateUnknown(Exception):
    """The append was sent and no answer came: it may be in the log, or arrive there later
    (``fence`` tells, once Redis answers)."""


@dataclass(frozen=True, slots=True)
class Appended:
    """In the log: just now (``new``), or already, by an earlier call with the same id."""

    known: Known
    new: bool

    @property
    def position(self) -> Position:
        return self.known.position


@dataclass(frozen=True, slots=True)
class AppendRefused:
    """Not appended, certainly: the log's epoch is not the one named (``epoch``: the one in
    force, None for none), or the id was fenced since its generation was read (``fenced``)."""

    epoch: str | None = None
    fenced: int | None = None


@dataclass(frozen=True, slots=True)
class IdState:
    """A change id as the log knows it: in the log (``known``), or not, at generation ``n``."""

    known: Known | None
    generation: int = 0

    @classmethod
    def parse(cls, raw: str | bytes | None) -> IdState:
        text = raw.decode() if isinstance(raw, bytes) else raw
        if not text:
            return cls(None)
        if text.startswith("p:"):
            return cls(Known.decode(text[2:]))
        try:
            return cls(None, int(text[2:]))
        except ValueError:
            return cls(None)


@dataclass(frozen=True, slots=True)
class LogKeys:
    """The Redis keys of one fleet's log. Replicas that share a Redis and a fleet name are one
    fleet; another name lets a second fleet share the Redis."""

    log: str
    snapshot: str
    epoch: str
    ids: str  # the prefix of the ids' keys

    @classmethod
    def of(cls, prefix: str, fleet: str) -> LogKeys:
        base = f"{prefix}{fleet}:"
        return cls(
            log=base + "log", snapshot=base + "snapshot", epoch=base + "epoch", ids=base + "id:"
        )

    def id(self, change_id: str) -> str:
        return self.ids + change_id


class ChangeLog(Protocol):
    """What a replica needs of its fleet's change log. Failures to reach it raise ``OSError``,
    ``TimeoutError`` or Redis's errors (an append: ``NotAppended`` or ``FateUnknown``); the
    caller decides (refuse a change, retry)."""

    async def append(
        self, change: Change, *, epoch: str, attempt: int = 0
    ) -> Appended | AppendRefused:
        """Add ``change`` at the end of the log of ``epoch``, unless its id is there already
        or was fenced past ``attempt``."""
        ...

    async def find(self, change_id: str) -> IdState:
        """What the log knows of ``change_id`` now (a change on its way may still arrive)."""
        ...

    async def fence(self, change_id: str) -> IdState:
        """What the log knows of ``change_id``, for good: absent now, it never arrives."""
        ...

    async def establish(self, epoch: str) -> str:
        """Give the log ``epoch`` unless it has one; the epoch in force."""
        ...

    async def heal(self, seen: str | None, epoch: str, snapshot: Snapshot | None) -> bool:
        """Start the log again under ``epoch`` from ``snapshot`` (None: from nothing), unless
        its epoch is no longer ``seen``."""
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


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


async def send_once(redis: Redis, within: float, *args: Any) -> Any:
    """One command on a connection of its own, never retried: ``NotAppended`` if no connection
    could be made (nothing was sent), ``FateUnknown`` if it was sent and no answer came within
    ``within`` s (or the connection broke meanwhile). Redis's error answers are raised."""
    pool = redis.connection_pool
    try:
        conn = await asyncio.wait_for(pool.get_connection(), within)  # type: ignore[no-untyped-call]
    except (RedisError, OSError, TimeoutError) as exc:
        raise NotAppended(str(exc) or type(exc).__name__) from exc
    try:
        try:
            await conn.send_command(*args)
            return await asyncio.wait_for(conn.read_response(), within)
        except ResponseError:
            raise
        except BaseException as exc:
            await conn.disconnect()  # what it holds now is unknown: never reused
            if isinstance(exc, RedisError | OSError | TimeoutError):
                raise FateUnknown(str(exc) or type(exc).__name__) from exc
            raise
    finally:
        await pool.release(conn)


class RedisLog:
    """One fleet's change log on Redis. ``redis`` is owned by the caller (opened and closed
    there); ``timeout``: how long an append waits for Redis's answer before its fate is
    unknown."""

    def __init__(self, redis: Redis, keys: LogKeys, *, timeout: float = 2.0) -> None:
        self.redis = redis
        self.keys = keys
        self.timeout = timeout
        self._compact = redis.register_script(_COMPACT_LUA)
        self._fence = redis.register_script(_FENCE_LUA)
        self._heal = redis.register_script(_HEAL_LUA)

    async def append(
        self, change: Change, *, epoch: str, attempt: int = 0
    ) -> Appended | AppendRefused:
        """Add ``change`` at the end of the log of ``epoch``, unless its id is there already
        (``Appended.new`` False: the earlier one) or was fenced past ``attempt``. Sent once:
        ``NotAppended`` or ``FateUnknown`` when Redis does not answer."""
        keys = self.keys
        entry = change.encode()["change"]
        kind, value = await send_once(
            self.redis,
            self.timeout,
            "EVAL", _APPEND_LUA, 3, keys.epoch, keys.id(change.id), keys.log,
            epoch, attempt, ID_TTL_MS, entry, change.fingerprint,
        )  # fmt: skip
        kind, value = _text(kind), _text(value)
        if kind == "new":
            return Appended(Known(Position.parse(value), change.fingerprint), new=True)
        if kind == "dup":
            return Appended(Known.decode(value), new=False)
        if kind == "fenced":
            return AppendRefused(fenced=int(value))
        return AppendRefused(epoch=value or None)

    async def find(self, change_id: str) -> IdState:
        return IdState.parse(await self.redis.get(self.keys.id(change_id)))

    async def fence(self, change_id: str) -> IdState:
        raw = await self._fence(keys=[self.keys.id(change_id)], args=[ID_TTL_MS])
        return IdState.parse(raw)

    async def establish(self, epoch: str) -> str:
        await self.redis.set(self.keys.epoch, epoch, nx=True)
        return _text(await self.redis.get(self.keys.epoch))

    async def heal(self, seen: str | None, epoch: str, snapshot: Snapshot | None) -> bool:
        keys = self.keys
        ids = snapshot.ids if snapshot is not None else {}
        done = await self._heal(
            keys=[keys.epoch, keys.snapshot, keys.log, *(keys.id(i) for i in ids)],
            args=[
                seen or "",
                epoch,
                "" if snapshot is None else str(snapshot.position),
                "" if snapshot is None else snapshot.encode(),
                "" if snapshot is None else snapshot.encode_ids(),
                ID_TTL_MS,
                *(k.encode() for k in ids.values()),
            ],
        )
        return bool(done)

    async def head(self) -> Position | None:
        """The last change's position (or the snapshot's, when the log was compacted since);
        None for an empty log."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xrevrange(self.keys.log, count=1)
            pipe.hget(self.keys.snapshot, "position")
            last, snapshot_at = await pipe.execute()
        return _head(last, snapshot_at)

    async def extent(self) -> tuple[int, Position | None]:
        """How many entries the log holds, and the position of its snapshot (None: none yet)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xlen(self.keys.log)
            pipe.hget(self.keys.snapshot, "position")
            length, snapshot_at = await pipe.execute()
        return int(length), None if snapshot_at is None else Position.parse(snapshot_at)

    async def after(self, applied: Position | None, *, count: int = 256) -> Batch:
        """What follows ``applied`` (None: nothing applied yet), at most ``count`` entries: the
        snapshot first when ``applied`` is behind it; with the log's epoch and head."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hmget(self.keys.snapshot, ["position", "state", "ids"])
            start = "-" if applied is None else f"({applied}"
            pipe.xrange(self.keys.log, min=start, max="+", count=count)
            pipe.get(self.keys.epoch)
            pipe.xrevrange(self.keys.log, count=1)
            (snapshot_at, state, ids), rows, epoch, last = await pipe.execute()
        snapshot = Snapshot.decode(snapshot_at, state, ids) if snapshot_at is not None else None
        head = _head(last, snapshot_at)
        if not behind(snapshot, applied):
            snapshot = None
        floor = snapshot.position if snapshot is not None else applied
        positioned = [(Position.parse(raw), fields) for raw, fields in rows]
        entries = [
            (position, Change.decode(fields))
            for position, fields in positioned
            if floor is None or position > floor
        ]
        return Batch(snapshot, entries, None if epoch is None else _text(epoch), head)

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
                snapshot.encode_ids(),
            ],
        )
        return bool(done)


def _head(last: Any, snapshot_at: Any) -> Position | None:
    if last:
        return Position.parse(last[0][0])
    return Position.parse(snapshot_at) if snapshot_at else None
