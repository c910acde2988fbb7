"""Followers of one change log on a real Redis, each applying to a state of its own (a small
model of a replica: which backends are drained): same changes, same order, same state; a
replica that was away catches up, from the snapshot where the log was compacted; Redis gone
and back."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from redis.asyncio import Redis

from gateway.fleet.changes import Batch, Change, Position, Snapshot, change_id
from gateway.fleet.follower import ChangeOutcome, Follower, LogLost
from gateway.fleet.log import Appended, AppendRefused, LogKeys, RedisLog
from tests.redis_server import RedisServer
from tests.waiting import wait_for


@dataclass
class Replica:
    """Applies drain/undrain of known backends; refuses an unknown one, as the admin API does."""

    backends: frozenset[str] = frozenset({"b0", "b1", "b2"})
    drained: list[str] = field(default_factory=list)  # in the order applied: order matters
    seen: list[Position] = field(default_factory=list)

    async def apply(self, position: Position, change: Change) -> ChangeOutcome:
        self.seen.append(position)
        _, _, _, backend, verb = change.path.split("/")
        if backend not in self.backends:
            return ChangeOutcome(404, f"no backend {backend}".encode())
        if verb == "drain" and backend not in self.drained:
            self.drained.append(backend)
        if verb == "undrain" and backend in self.drained:
            self.drained.remove(backend)
        return ChangeOutcome(200, json.dumps({"drained": self.drained}).encode())

    async def restore(self, snapshot: Snapshot) -> None:
        self.drained = list(snapshot.state["drained"])

    def export(self) -> dict[str, Any]:
        return {"drained": list(self.drained)}


def change(verb: str, backend: str, replica: str = "r0") -> Change:
    return Change("POST", f"/admin/backends/{backend}/{verb}", replica=replica, id=change_id(None))


EPOCH = "0000000000001-test"


async def put(log: RedisLog, c: Change) -> Position:
    got = await log.append(c, epoch=await log.establish(EPOCH))
    assert isinstance(got, Appended), got
    return got.position


@contextlib.asynccontextmanager
async def following(follower: Follower) -> AsyncIterator[Follower]:
    task = asyncio.create_task(follower.run())
    try:
        yield follower
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_replicas_apply_the_same_changes_in_the_same_order(
    redis: Redis, redis_prefix: str, redis_url: str
) -> None:
    keys = LogKeys.of(redis_prefix, "f")
    others = [Redis.from_url(redis_url, socket_timeout=5.0) for _ in range(2)]
    replicas = [Replica() for _ in range(3)]
    followers = [
        Follower(RedisLog(c, keys), r, block=0.2)
        for c, r in zip([redis, *others], replicas, strict=True)
    ]
    await RedisLog(redis, keys).establish(EPOCH)
    try:
        async with following(followers[0]), following(followers[1]), following(followers[2]):
            # Two replicas accept conflicting changes at once: the log decides the order.
            a, b = RedisLog(others[0], keys), RedisLog(others[1], keys)
            made = await asyncio.gather(
                *(
                    put(log, change(verb, "b1", replica=name))
                    for _ in range(10)
                    for log, verb, name in ((a, "drain", "r1"), (b, "undrain", "r2"))
                )
            )
            last = max(made)
            outcomes = await asyncio.gather(*(f.reached(last, within=10.0) for f in followers))
    finally:
        for c in others:
            await c.aclose()
    assert all(o is not None and o.applied for o in outcomes)
    assert {tuple(r.seen) for r in replicas} == {tuple(sorted(made))}  # each once, in order
    assert len({tuple(r.drained) for r in replicas}) == 1  # the same state everywhere


async def test_a_refused_change_is_refused_everywhere_and_its_answer_is_the_handlers(
    redis: Redis, redis_prefix: str
) -> None:
    keys = LogKeys.of(redis_prefix, "f")
    one, two = Replica(), Replica()
    f1, f2 = Follower(RedisLog(redis, keys), one), Follower(RedisLog(redis, keys), two)
    log = RedisLog(redis, keys)
    await put(log, change("drain", "b0"))
    bad = await put(log, change("drain", "b9"))
    await f1.catch_up()
    await f2.catch_up()
    refused = await f1.reached(bad, within=1.0)
    assert refused == ChangeOutcome(404, b"no backend b9")
    assert one.drained == two.drained == ["b0"]


async def test_a_replica_that_starts_late_catches_up_from_the_snapshot(
    redis: Redis, redis_prefix: str
) -> None:
    keys = LogKeys.of(redis_prefix, "f")
    log = RedisLog(redis, keys)
    early = Replica()
    follower = Follower(log, early)
    for verb, b in (("drain", "b0"), ("drain", "b1"), ("undrain", "b0"), ("drain", "b2")):
        await put(log, change(verb, b))
    await follower.catch_up()
    assert follower.applied is not None
    taken = await follower.snapshot()
    assert taken is not None
    assert taken.position == follower.applied
    assert await log.compact(taken, None)
    after = await put(log, change("drain", "b0"))
    late = Replica()
    applied = await Follower(log, late).catch_up()
    assert applied == 1  # the snapshot, then the one change after it
    assert late.drained == ["b1", "b2", "b0"]
    await follower.catch_up()
    assert early.drained == late.drained
    assert late.seen == [after]
    # A change the late one learnt through the snapshot is answered as applied, not "pending".
    covered = await Follower(log, Replica()).reached(taken.position, within=0.0)
    assert covered is None  # that follower never caught up: not applied there
    third = Follower(log, Replica())
    await third.catch_up()
    answer = await third.reached(taken.position, within=0.0)
    assert answer is not None
    assert answer.applied


async def test_a_replica_cut_off_from_redis_keeps_its_state_and_catches_up_on_its_return(
    own_redis: RedisServer,
) -> None:
    keys = LogKeys.of("t:", "f")
    client = Redis.from_url(own_redis.url, socket_timeout=2.0, socket_connect_timeout=0.5)
    replica = Replica()
    follower = Follower(RedisLog(client, keys), replica, block=0.2, retry=0.05)
    writer = RedisLog(client, keys)
    try:
        await writer.establish(EPOCH)
        async with following(follower):
            first = await put(writer, change("drain", "b0"))
            assert await follower.reached(first, within=10.0) is not None
            own_redis.pause()
            await wait_for(lambda: not follower.reachable, what="the follower to notice")
            assert replica.drained == ["b0"]  # the last applied state stays
            own_redis.resume()
            second = await put(writer, change("drain", "b1"))
            assert await follower.reached(second, within=10.0) is not None
            assert follower.reachable
    finally:
        await client.aclose()
    assert replica.drained == ["b0", "b1"]


async def test_a_log_lost_with_its_redis_is_noticed_nothing_goes_into_it_and_healed_it_is_adopted(
    own_redis: RedisServer,
) -> None:
    """Redis restarted empty: the follower keeps its state and hands the loss to its healer
    (nothing of a new log is applied meanwhile, no change can be appended to it); healed with
    the state of the replica furthest ahead, a follower that was behind adopts it."""
    keys = LogKeys.of("t:", "f")
    client = Redis.from_url(own_redis.url, socket_timeout=2.0, socket_connect_timeout=0.5)
    ahead, behind_ = Replica(), Replica()
    losses: list[LogLost] = []

    async def heal(lost: LogLost) -> None:
        losses.append(lost)
        await asyncio.sleep(0.01)  # sleep-ok: a healer's turn, as the member's settle wait

    leader = Follower(RedisLog(client, keys), ahead, block=0.2, retry=0.05, heal=heal)
    late = Follower(RedisLog(client, keys), behind_, block=0.2, retry=0.05, heal=heal)
    writer = RedisLog(client, keys)
    try:
        first = await put(writer, change("drain", "b0"))
        await late.catch_up()  # it applied b0 only
        second = await put(writer, change("drain", "b1"))
        await leader.catch_up()
        assert leader.applied == second
        assert late.applied == first
        own_redis.stop()
        own_redis.start()  # empty
        async with following(leader), following(late):
            await wait_for(lambda: leader.lost is not None and late.lost is not None, what="lost")
            assert losses[0].seen is None
            assert losses[0].known == EPOCH
            refused = await writer.append(change("drain", "b2"), epoch=EPOCH)
            assert refused == AppendRefused(epoch=None)  # nothing goes into a lost log
            assert ahead.drained == ["b0", "b1"]
            assert behind_.drained == ["b0"]
            snapshot = await leader.snapshot()
            assert await writer.heal(None, "0000000000002-new", snapshot)
            assert not await writer.heal(None, "0000000000003-other", snapshot)  # one heals
            leader.adopt_own("0000000000002-new")
            await wait_for(
                lambda: late.epoch == "0000000000002-new" and late.lost is None, what="adopted"
            )
            third = await writer.append(change("drain", "b2"), epoch="0000000000002-new")
            assert isinstance(third, Appended)
            assert third.position > second  # after everything applied before the loss
            for f in (leader, late):
                assert await f.reached(third.position, within=10.0) is not None
    finally:
        await client.aclose()
    assert ahead.drained == behind_.drained == ["b0", "b1", "b2"]


async def test_a_log_put_back_from_an_older_copy_is_lost_to_a_replica_that_applied_more(
    redis: Redis, redis_prefix: str
) -> None:
    """A Redis restored from a backup: the same epoch behind what was applied (rewound), or an
    older epoch, is a lost log (healed by the fleet), never applied as it is."""
    keys = LogKeys.of(redis_prefix, "f")
    log = RedisLog(redis, keys)
    follower = Follower(log, Replica())
    first = await put(log, change("drain", "b0"))
    copy = {k: await redis.dump(k) for k in (keys.log, keys.epoch, keys.snapshot)}
    await put(log, change("drain", "b1"))
    await follower.catch_up()
    for key, value in copy.items():  # the backup, put back
        await redis.delete(key)
        if value is not None:
            await redis.restore(key, 0, value)
    assert (await log.after(None)).head == first
    with pytest.raises(LogLost) as rewound:
        await follower.catch_up()
    assert (rewound.value.seen, rewound.value.head) == (EPOCH, first)
    assert follower.lost is not None
    await redis.set(keys.epoch, "0000000000000-older")  # an older log altogether
    late = Follower(log, Replica())
    late.epoch = EPOCH  # as a replica that followed the newer one
    with pytest.raises(LogLost) as older:
        await late.catch_up()
    assert older.value.seen == "0000000000000-older"


async def test_a_replica_adopting_a_healed_log_never_shows_its_files_state_meanwhile(
    redis: Redis, redis_prefix: str
) -> None:
    """Between taking a new epoch and reading its snapshot a replica awaits Redis; requests
    and views run then. They see the state it had, then the snapshot's: never the state
    before any change (a run-time key gone, an alias back to the file's)."""
    keys = LogKeys.of(redis_prefix, "f")
    replica = Replica()
    seen: list[list[str]] = []

    class Spy(RedisLog):
        async def after(self, applied: Position | None, *, count: int = 256) -> Batch:
            seen.append(list(replica.drained))  # what a request sees while Redis is asked
            return await super().after(applied, count=count)

    log = Spy(redis, keys)
    follower = Follower(log, replica)
    await put(log, change("drain", "b0"))
    await follower.catch_up()
    assert replica.drained == ["b0"]
    snapshot = await follower.snapshot()
    assert await log.heal(EPOCH, "0000000000002-new", snapshot)  # healed by another replica
    seen.clear()
    await follower.catch_up()
    assert follower.epoch == "0000000000002-new"
    assert [] not in seen
    assert replica.drained == ["b0"]
