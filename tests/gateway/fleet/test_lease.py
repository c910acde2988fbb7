"""The lease on a duty (a rollout's driving), on a real Redis: one holder at a time, a growing
fencing token for each new holder, taken over once the holder stops renewing, and a stale
holder refused when it comes back."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from gateway.fleet.lease import DutyLease


async def taken(lease: DutyLease) -> int:
    """Poll until ``lease`` is taken (the other holder's lapsed); its token."""
    async with asyncio.timeout(10):
        while True:
            token = await lease.acquire()
            if token is not None:
                return token
            await asyncio.sleep(0.01)  # sleep-ok: polling until Redis expires the other's hold


async def test_one_holder_at_a_time_and_its_token(redis: Redis, redis_prefix: str) -> None:
    key = redis_prefix + "rollout:chat"
    a, b = DutyLease(redis, key, "r0", ttl=30), DutyLease(redis, key, "r1", ttl=30)
    assert await a.acquire() == 1
    assert await b.acquire() is None  # r0 holds it
    assert await a.acquire() == 1  # acquiring again extends it, the same token
    assert await a.renew()
    assert not await b.renew()
    assert await a.held_by() == "r0"


async def test_a_holder_that_stops_renewing_is_taken_over_and_refused_after(
    redis: Redis, redis_prefix: str
) -> None:
    key = redis_prefix + "rollout:chat"
    stalled = DutyLease(redis, key, "r0", ttl=0.2)
    successor = DutyLease(redis, key, "r1", ttl=30)
    first = await stalled.acquire()
    assert first is not None
    second = await taken(successor)  # r0 never renewed: its hold lapsed
    assert second > first  # the fencing token grew
    assert not await stalled.renew()  # r0 back from its stall: no longer the holder
    assert stalled.token is None
    assert await stalled.acquire() is None
    assert await successor.held_by() == "r1"


async def test_release_frees_it_at_once_and_only_for_its_holder(
    redis: Redis, redis_prefix: str
) -> None:
    key = redis_prefix + "rollout:chat"
    a, b = DutyLease(redis, key, "r0", ttl=30), DutyLease(redis, key, "r1", ttl=30)
    first = await a.acquire()
    assert first is not None
    assert not await b.release()  # not b's to give up
    assert await a.held_by() == "r0"
    assert await a.release()
    assert await a.held_by() is None
    assert await b.acquire() == first + 1  # taken at once, with the next token


async def test_leases_of_two_duties_are_apart(redis: Redis, redis_prefix: str) -> None:
    chat = DutyLease(redis, redis_prefix + "rollout:chat", "r0", ttl=30)
    embed = DutyLease(redis, redis_prefix + "rollout:embed", "r1", ttl=30)
    assert await chat.acquire() == 1
    assert await embed.acquire() == 1


def test_a_lease_needs_a_ttl(redis: Redis) -> None:
    with pytest.raises(ValueError, match="ttl"):
        DutyLease(redis, "k", "r0", ttl=0)
