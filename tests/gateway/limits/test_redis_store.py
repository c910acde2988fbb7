"""The Redis store against a real Redis: atomic admission shared by two gateways, expiry of
everything it writes, and its failure modes when Redis goes away and comes back."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable

import pytest
import redis
from redis.asyncio import Redis
from structlog.testing import capture_logs

from backends.errors import LimitsUnavailable
from gateway.limits.budget import Counted
from gateway.limits.redis_store import _ADMIT, _SETTLE, RedisLimitStore
from gateway.limits.settings import RedisSettings
from gateway.limits.store import Limits, Used, finish
from tests.helpers import wait_for
from tests.redis_server import RedisServer

StoreFactory = Callable[..., RedisLimitStore]


@pytest.fixture
async def make_store(redis_url: str, redis_prefix: str) -> AsyncIterator[StoreFactory]:
    """Builds independent stores (each its own connection pool: one per 'gateway')."""
    made: list[RedisLimitStore] = []

    def build(url: str = redis_url, **overrides: object) -> RedisLimitStore:
        fields: dict[str, object] = {"url": url, "key_prefix": redis_prefix, "timeout": 0.5}
        fields.update(overrides)
        store = RedisLimitStore.from_settings(RedisSettings.model_validate(fields))
        made.append(store)
        return store

    yield build
    for s in made:
        await s.aclose()


def sync_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


async def test_admits_until_the_request_limit_then_refuses_with_figures(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    limits = Limits(requests_per_minute=3, tokens_per_minute=600)
    decisions = [await store.admit("k", limits, 100) for _ in range(4)]
    assert [d.allowed for d in decisions] == [True, True, True, False]
    assert decisions[0].requests is not None
    assert decisions[0].tokens is not None
    assert (decisions[0].requests.limit, decisions[0].requests.remaining) == (3, 2)
    assert (decisions[0].tokens.limit, decisions[0].tokens.remaining) == (600, 500)
    refused = decisions[3]
    assert refused.reason == "requests"
    assert 19.0 < refused.retry_after <= 20.0  # one request at 3/min, less what refilled


async def test_token_reservation_settles_against_real_usage(make_store: StoreFactory) -> None:
    store = make_store()
    limits = Limits(tokens_per_minute=1000)
    first = await store.admit("k", limits, 600)
    assert first.allowed
    second = await store.admit("k", limits, 600)
    assert second.reason == "tokens"
    assert first.ticket is not None
    await store.settle(first.ticket, 50)
    await store.settle(first.ticket, 50)  # once only
    assert (await store.admit("k", limits, 900)).allowed
    assert not (await store.admit("k", limits, 600)).allowed


async def test_request_larger_than_the_budget_is_too_large(make_store: StoreFactory) -> None:
    d = await make_store().admit("k", Limits(tokens_per_minute=100), 101)
    assert (d.allowed, d.reason) == (False, "too_large")


async def test_keys_expire_once_full_and_slots_carry_a_ttl(
    make_store: StoreFactory, redis_url: str
) -> None:
    store = make_store(slot_ttl=30)
    limits = Limits(requests_per_minute=60, tokens_per_minute=6000, max_concurrent=4)
    d = await store.admit("k", limits, 100)
    assert d.ticket is not None
    bucket_key, slots_key = store.redis_keys("k")
    c = sync_client(redis_url)
    try:
        assert 0 < c.pttl(bucket_key) <= 2000  # full again in 1 s, plus a second of slack
        assert 29_000 < c.pttl(slots_key) <= 31_000
        assert c.zcard(slots_key) == 1
        await finish(store, d.ticket, 0)
        assert c.zcard(slots_key) == 0
    finally:
        c.close()


async def test_refund_to_full_deletes_the_bucket(make_store: StoreFactory, redis_url: str) -> None:
    store = make_store()
    d = await store.admit("k", Limits(tokens_per_minute=1000), 100)
    assert d.ticket is not None
    await store.settle(d.ticket, 0)
    c = sync_client(redis_url)
    try:
        assert c.exists(store.redis_keys("k")[0]) == 0
    finally:
        c.close()


async def test_two_gateways_bursting_one_key_stay_within_requests_and_tokens(
    make_store: StoreFactory,
) -> None:
    # Opened as a gateway opens them at start: 120 calls at once then share each store's
    # connections instead of opening 120, which on a busy machine outlasts the timeout.
    a, b = make_store(), make_store()
    await asyncio.gather(a.open(), b.open())

    async def burst(limits: Limits, cost: int, per_gateway: int) -> tuple[int, float]:
        started = time.monotonic()
        results = await asyncio.gather(
            *(s.admit("shared", limits, cost) for _ in range(per_gateway) for s in (a, b))
        )
        return sum(d.allowed for d in results), time.monotonic() - started

    # Requests bind: 20 a minute, 60 asked for from each gateway at once.
    limits = Limits(requests_per_minute=20, tokens_per_minute=10**6)
    admitted, elapsed = await burst(limits, 10, 60)
    assert 20 <= admitted <= 20 + int(elapsed * 20 / 60)

    # Tokens bind: 70 each against 1000 a minute (another key, fresh buckets).
    limits = Limits(tokens_per_minute=1000)
    started = time.monotonic()
    results = await asyncio.gather(
        *(s.admit("shared-tokens", limits, 70) for _ in range(60) for s in (a, b))
    )
    elapsed = time.monotonic() - started
    admitted = sum(d.allowed for d in results)
    assert admitted >= 14
    assert admitted * 70 <= 1000 + elapsed * 1000 / 60


async def test_two_gateways_share_concurrency_slots(make_store: StoreFactory) -> None:
    a, b = make_store(), make_store()
    limits = Limits(max_concurrent=5)
    results = await asyncio.gather(*(s.admit("c", limits, 0) for _ in range(20) for s in (a, b)))
    held = [d for d in results if d.allowed]
    assert len(held) == 5
    assert {d.reason for d in results if not d.allowed} == {"concurrency"}
    for d in held:
        assert d.ticket is not None
        await a.release(d.ticket)
        await a.release(d.ticket)  # twice: still only one slot back
    results = await asyncio.gather(*(s.admit("c", limits, 0) for _ in range(20) for s in (a, b)))
    assert sum(d.allowed for d in results) == 5


async def test_slots_of_a_crashed_gateway_come_back_after_their_ttl(
    make_store: StoreFactory,
) -> None:
    crashed, alive = make_store(slot_ttl=0.2), make_store(slot_ttl=0.2)
    limits = Limits(max_concurrent=1)
    assert (await crashed.admit("k", limits, 0)).allowed  # never released
    assert (await alive.admit("k", limits, 0)).reason == "concurrency"

    admitted: list[bool] = []

    async def try_admit() -> None:
        admitted.append((await alive.admit("k", limits, 0)).allowed)

    deadline = time.monotonic() + 10
    while not (admitted and admitted[-1]):
        assert time.monotonic() < deadline, "the crashed gateway's slot never came back"
        await try_admit()
        await asyncio.sleep(0.02)  # sleep-ok: polling interval of a deadline-bounded wait


async def test_script_reloaded_after_redis_forgets_it(
    make_store: StoreFactory, own_redis: RedisServer
) -> None:
    store = make_store(url=own_redis.url)
    limits = Limits(requests_per_minute=2)
    assert (await store.admit("k", limits, 0)).allowed
    c = sync_client(own_redis.url)
    try:
        c.script_flush()
    finally:
        c.close()
    assert (await store.admit("k", limits, 0)).allowed
    assert not (await store.admit("k", limits, 0)).allowed


async def test_redis_stopped_then_restarted_fail_open(
    make_store: StoreFactory, own_redis: RedisServer
) -> None:
    store = make_store(url=own_redis.url, timeout=0.05, retry_interval=0, failure_mode="open")
    limits = Limits(requests_per_minute=2, max_concurrent=10)
    assert (await store.admit("k", limits, 0)).allowed
    own_redis.stop()
    with capture_logs() as logs:
        outage = [await store.admit("k", limits, 0) for _ in range(5)]
        assert all(d.allowed and d.degraded for d in outage)
        assert all(d.ticket is not None and not d.ticket.accounted for d in outage)
        assert not store.available
        own_redis.start()
        # Enforced again: fresh Redis, so the bucket is full (2), then refusal.
        again = [await store.admit("k", limits, 0) for _ in range(3)]
    assert [(d.allowed, d.degraded) for d in again] == [
        (True, False),
        (True, False),
        (False, False),
    ]
    events = [e["event"] for e in logs]
    assert events.count("limits_store_unavailable") == 1
    assert events.count("limits_store_recovered") == 1
    assert store.available


async def test_redis_stopped_then_restarted_fail_closed(
    make_store: StoreFactory, own_redis: RedisServer
) -> None:
    store = make_store(url=own_redis.url, timeout=0.05, retry_interval=0, failure_mode="closed")
    limits = Limits(requests_per_minute=1)
    assert (await store.admit("k", limits, 0)).allowed
    own_redis.stop()
    with pytest.raises(LimitsUnavailable) as info:
        await store.admit("k", limits, 0)
    assert info.value.status == 503
    assert info.value.headers["Retry-After"] == "1"
    own_redis.start()
    assert (await store.admit("k", limits, 0)).allowed
    assert (await store.admit("k", limits, 0)).reason == "requests"


async def test_a_budget_is_one_count_for_every_client_and_follows_the_failure_mode(
    make_store: StoreFactory, own_redis: RedisServer
) -> None:
    stores = [
        make_store(url=own_redis.url, timeout=0.5, retry_interval=0, failure_mode=mode)
        for mode in ("closed", "open")
    ]
    closed, opened = stores
    day, month = Counted("day", "day:2026-12-05", 1000), Counted("month", "month:2026-12", 5000)
    names = [day.name, month.name]
    # 20 charges of 100 at once from two clients on 1,000 a day: exactly 10 taken, from both.
    results = await asyncio.gather(
        *(stores[i % 2].charge_budget("key:team", 100, [day, month]) for i in range(20))
    )
    assert sum(1 for r in results if r is None) == 10
    assert {r for r in results if r is not None} == {(day, 1000)}  # the day's count refused
    assert await closed.budget_spent("key:team", names) == [1000, 1000]
    # Three used nothing after all; one used 50 of model "m".
    await opened.settle_budget("key:team", names, 300, None)
    await opened.settle_budget("key:team", names, 50, Used("2026-12-05", "m", 50))
    assert await closed.budget_spent("key:team", names) == [650, 650]
    assert await closed.budget_usage("key:team", ["2026-12-05", "2026-12-04"]) == {
        "2026-12-05": {"m": 50}
    }
    assert await closed.charge_budget("key:team", 350, [day, month]) is None
    assert await closed.charge_budget("key:team", 1, [day, month]) == (day, 1000)
    assert await closed.budget_spent("key:other", names) == [0, 0]  # another owner: apart
    own_redis.stop()
    with pytest.raises(LimitsUnavailable):
        await closed.charge_budget("key:team", 1, [day])
    assert await opened.charge_budget("key:team", 1, [day]) is None  # unchecked: fail-open
    assert await opened.budget_spent("key:team", names) is None
    assert await opened.budget_usage("key:team", ["2026-12-05"]) is None
    await opened.settle_budget("key:team", names, 1, None)  # lost, and said nowhere: no raise


async def test_open_connects_the_whole_pool_and_loads_the_scripts(
    make_store: StoreFactory, redis_url: str
) -> None:
    """What keeps a fresh gateway's first burst within its limits (it used to open one
    connection per request and fail open when they outlasted the timeout)."""
    c = sync_client(redis_url)
    try:
        c.script_flush()
        before = c.info("clients")["connected_clients"]
        store = make_store(max_connections=6)
        with capture_logs() as logs:
            await store.open()
        assert c.info("clients")["connected_clients"] - before >= 6
        assert c.script_exists(*(s.sha for s in (_ADMIT, _SETTLE))) == [True, True]
    finally:
        c.close()
    assert [e["event"] for e in logs] == ["limits_store_connected"]
    assert logs[0]["connections"] == 6


async def test_open_with_redis_out_of_reach_returns_and_the_failure_mode_applies(
    make_store: StoreFactory,
) -> None:
    hole = socket.socket()  # accepts, never answers
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    try:
        url = f"redis://127.0.0.1:{hole.getsockname()[1]}/0"
        store = make_store(url=url, timeout=0.05, failure_mode="closed")
        with capture_logs() as logs:  # the hole never answers: only giving up ends this
            await store.open(within=0.5)
        assert [e["event"] for e in logs] == ["limits_store_unavailable_at_start"]
        with pytest.raises(LimitsUnavailable):
            await store.admit("k", Limits(requests_per_minute=1), 0)
    finally:
        hole.close()


async def test_a_redis_that_never_answers_costs_one_timeout_then_the_mode(
    make_store: StoreFactory,
) -> None:
    """A black hole (accepts, never replies): the call gives up after the timeout, no hang."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    try:
        url = f"redis://127.0.0.1:{hole.getsockname()[1]}/0"
        closed = make_store(url=url, timeout=0.05, failure_mode="closed", retry_interval=60)
        with pytest.raises(LimitsUnavailable):  # the hole never answers: the timeout ended it
            await closed.admit("k", Limits(requests_per_minute=1), 0)
        # Within the retry interval Redis is not tried again; the mode applies at once.
        with pytest.raises(LimitsUnavailable):
            await closed.admit("k", Limits(requests_per_minute=1), 0)
        opened = make_store(url=url, timeout=0.05, failure_mode="open")
        d = await opened.admit("k", Limits(requests_per_minute=1), 0)
        assert d.allowed
        assert d.degraded
    finally:
        hole.close()


async def test_release_while_redis_is_down_does_not_raise(
    make_store: StoreFactory, own_redis: RedisServer
) -> None:
    store = make_store(url=own_redis.url, timeout=0.05, retry_interval=0)
    d = await store.admit("k", Limits(max_concurrent=1, tokens_per_minute=100), 50)
    assert d.ticket is not None
    own_redis.stop()
    await finish(store, d.ticket, 10)  # logged, slot left to expire
    assert not d.ticket.open


async def test_unlimited_key_never_touches_redis() -> None:
    client = Redis.from_url("redis://127.0.0.1:1/0")  # nothing listens there
    store = RedisLimitStore(client, failure_mode="closed")
    try:
        d = await store.admit("k", Limits(), 100)
        assert d.allowed
        assert not d.degraded
    finally:
        await store.aclose()


async def test_a_slot_released_during_a_blip_is_given_back_when_redis_answers_again(
    make_store: StoreFactory, own_redis: RedisServer
) -> None:
    """Issue 16.10: a release that met a frozen Redis was skipped, and the key's concurrency
    slot stayed taken until slot_ttl (900 s). Now it waits in the backlog and goes through
    (with the token correction) as soon as Redis answers."""
    store = make_store(url=own_redis.url, timeout=0.1, retry_interval=0.05)
    limits = Limits(max_concurrent=1, tokens_per_minute=1000)
    held = await store.admit("k", limits, 600)
    assert held.ticket is not None
    c = sync_client(own_redis.url)
    assert own_redis.proc is not None
    try:
        own_redis.proc.send_signal(signal.SIGSTOP)  # a blip: Redis keeps its data, stops answering
        await finish(store, held.ticket, 100)  # the request ends during it
        own_redis.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 5
        while c.zcard(store.redis_keys("k")[1]):
            assert time.monotonic() < deadline, "the owed release never reached Redis"
            await asyncio.sleep(0.01)  # sleep-ok: polling interval of a deadline-bounded wait
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
        c.close()
    again = await store.admit("k", limits, 800)  # the slot and the 500 refunded tokens are back
    assert again.allowed, again.reason


async def test_the_backlog_is_bounded(make_store: StoreFactory, own_redis: RedisServer) -> None:
    store = make_store(url=own_redis.url, timeout=0.05, retry_interval=10, max_backlog=3)
    limits = Limits(max_concurrent=10)
    tickets = [(await store.admit("k", limits, 0)).ticket for _ in range(5)]
    own_redis.stop()
    for t in tickets:
        assert t is not None
        await store.release(t)
    assert (store.backlog, store.backlog_dropped) == (3, 2)


async def released(c: Redis, store: RedisLimitStore, what: str) -> None:
    """Until key ``k`` holds no concurrency slot in Redis (within 5 s)."""
    deadline = time.monotonic() + 5
    while await c.zcard(store.redis_keys("k")[1]):
        assert time.monotonic() < deadline, f"{what} was never released"
        await asyncio.sleep(0.01)  # sleep-ok: polling interval of a deadline-bounded wait


async def test_an_admission_whose_answer_came_too_late_gives_its_slot_back(
    make_store: StoreFactory, own_redis: RedisServer
) -> None:
    """Found by the soak: Redis ran the admission script after the store had given up waiting
    (fail-open), and the slot it took was never released: 15 minutes of a key's concurrency."""
    store = make_store(url=own_redis.url, timeout=0.05, retry_interval=0.05)
    limits = Limits(max_concurrent=4)
    warm = await store.admit("k", limits, 0)  # loads the script
    assert warm.ticket is not None
    await store.release(warm.ticket)
    c = Redis.from_url(own_redis.url)
    try:
        before = await scripts_run(c)
        own_redis.pause()  # no answer until resumed, however slow this machine
        try:
            late = await store.admit("k", limits, 0)
        finally:
            own_redis.resume()
        await ran_after(c, before)  # Redis ran it all the same: it holds a slot
        assert late.degraded  # admitted without limits: the answer did not come in time
        assert late.ticket is not None
        await store.release(late.ticket)
        await released(c, store, "the late admission's slot")
    finally:
        await c.aclose()


async def test_an_admission_cancelled_while_in_redis_gives_its_slot_back(
    make_store: StoreFactory, own_redis: RedisServer
) -> None:
    """Found by the soak (CI): a client that left 1-40 ms after sending (its handler cancelled
    while the admission script was on its way to Redis) left a slot held for the slot TTL."""
    store = make_store(url=own_redis.url, timeout=60.0, retry_interval=0.05)
    limits = Limits(max_concurrent=4)
    warm = await store.admit("k", limits, 0)  # loads the script
    assert warm.ticket is not None
    await store.release(warm.ticket)
    c = Redis.from_url(own_redis.url)
    try:
        before = await scripts_run(c)
        own_redis.pause()  # the script waits, unread, in Redis's socket: no race with a clock
        try:
            admitting = asyncio.create_task(store.admit("k", limits, 0))
            await wait_for(lambda: own_redis.unread() > 0, what="the script sent to Redis")
            admitting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await admitting
        finally:
            own_redis.resume()
        # Redis runs the script the client left (it takes a slot), and the store gives it back.
        await ran_after(c, before)
        await released(c, store, "the cancelled admission's slot")
        assert store.available  # a cancelled call is not an outage
    finally:
        await c.aclose()


async def ran_after(c: Redis, before: int) -> None:
    """Until Redis has run a script more than the ``before`` it had (within 5 s)."""
    deadline = time.monotonic() + 5
    while await scripts_run(c) <= before:
        assert time.monotonic() < deadline, "Redis never ran the script"
        await asyncio.sleep(0.01)  # sleep-ok: polling interval of a deadline-bounded wait


async def scripts_run(c: Redis) -> int:
    """How many scripts Redis has run (``INFO commandstats``: EVALSHA and EVAL)."""
    stats = await c.info("commandstats")
    return sum(
        int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval")
    )


async def test_after_a_redis_restart_stale_connections_fail_once_not_once_each(
    make_store: StoreFactory, own_redis: RedisServer
) -> None:
    """Found by the soak: each pooled connection from before a restart failed on its next use,
    so failures (each a retry interval of fail-open admissions) went on for minutes, as load
    reached deeper into the pool. The first failure now drops every idle connection."""
    store = make_store(url=own_redis.url, timeout=0.5, retry_interval=0)
    limits = Limits(requests_per_minute=10_000)
    first = await asyncio.gather(*(store.admit("k", limits, 0) for _ in range(8)))
    assert not any(d.degraded for d in first)  # eight connections in the pool now
    own_redis.stop()
    own_redis.start()
    assert (await store.admit("k", limits, 0)).degraded  # the first use meets a dead socket
    after = await asyncio.gather(*(store.admit("k", limits, 0) for _ in range(8)))
    assert [d.degraded for d in after] == [False] * 8
