"""Token-bucket arithmetic and the in-memory store, on an injected clock."""

from __future__ import annotations

import asyncio

import pytest

from gateway.limits import bucket
from gateway.limits.memory import MemoryLimitStore
from gateway.limits.store import Limits, finish


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> MemoryLimitStore:
    return MemoryLimitStore(clock)


def test_refill_is_linear_and_capped() -> None:
    limits = Limits(requests_per_minute=60, tokens_per_minute=600)
    b = bucket.Buckets(requests=0.0, tokens=0.0, at=0.0)
    assert bucket.refill(b, limits, 1.0) == bucket.Buckets(1.0, 10.0, 1.0)
    assert bucket.refill(b, limits, 1000.0) == bucket.Buckets(60.0, 600.0, 1000.0)


def test_refill_ignores_a_clock_going_backwards() -> None:
    limits = Limits(requests_per_minute=60)
    b = bucket.Buckets(requests=5.0, tokens=0.0, at=10.0)
    assert bucket.refill(b, limits, 9.0) == b


def test_requests_per_minute_refuses_then_readmits_after_retry_after(
    store: MemoryLimitStore, clock: FakeClock
) -> None:
    limits = Limits(requests_per_minute=3)
    for _ in range(3):
        assert store.admit_now("k", limits, 0).allowed
    d = store.admit_now("k", limits, 0)
    assert not d.allowed
    assert d.reason == "requests"
    assert d.retry_after == pytest.approx(20.0)
    assert d.requests is not None
    assert (d.requests.limit, d.requests.remaining) == (3, 0)
    assert d.requests.reset == pytest.approx(60.0)
    clock.advance(19.9)
    assert not store.admit_now("k", limits, 0).allowed
    clock.advance(0.1)
    assert store.admit_now("k", limits, 0).allowed


def test_keys_have_separate_buckets(store: MemoryLimitStore) -> None:
    limits = Limits(requests_per_minute=1)
    assert store.admit_now("a", limits, 0).allowed
    assert store.admit_now("b", limits, 0).allowed
    assert not store.admit_now("a", limits, 0).allowed


def test_tokens_reserved_at_admission_and_refunded_at_settlement(
    store: MemoryLimitStore,
) -> None:
    limits = Limits(tokens_per_minute=1000)
    first = store.admit_now("k", limits, 600)
    assert first.allowed
    assert first.tokens is not None
    assert first.tokens.remaining == 400
    second = store.admit_now("k", limits, 600)
    assert not second.allowed
    assert second.reason == "tokens"
    assert second.retry_after == pytest.approx(12.0)  # 200 tokens at 1000/60 per second
    assert first.ticket is not None
    store.settle_now(first.ticket, 100)  # used 100 of the 600 reserved
    assert store.admit_now("k", limits, 600).allowed


def test_settling_twice_refunds_once(store: MemoryLimitStore) -> None:
    limits = Limits(tokens_per_minute=1000)
    d = store.admit_now("k", limits, 500)
    assert d.ticket is not None
    store.settle_now(d.ticket, 0)
    store.settle_now(d.ticket, 0)
    after = store.admit_now("k", limits, 1000)  # full again after one refund...
    assert after.allowed
    assert not store.admit_now("k", limits, 1).allowed  # ...and not more than full


def test_usage_above_the_reservation_puts_the_bucket_in_debt(
    store: MemoryLimitStore, clock: FakeClock
) -> None:
    limits = Limits(tokens_per_minute=600)
    d = store.admit_now("k", limits, 100)
    assert d.ticket is not None
    store.settle_now(d.ticket, 700)  # 600 more than reserved: level -100
    refused = store.admit_now("k", limits, 10)
    assert refused.reason == "tokens"
    assert refused.retry_after == pytest.approx(11.0)  # 110 tokens at 10/s
    clock.advance(11.0)
    assert store.admit_now("k", limits, 10).allowed


def test_a_request_larger_than_the_whole_budget_is_too_large(store: MemoryLimitStore) -> None:
    d = store.admit_now("k", Limits(tokens_per_minute=100), 101)
    assert (d.allowed, d.reason) == (False, "too_large")


def test_concurrency_slot_released_once_however_often_release_is_called(
    store: MemoryLimitStore,
) -> None:
    limits = Limits(max_concurrent=2)
    a = store.admit_now("k", limits, 0)
    b = store.admit_now("k", limits, 0)
    refused = store.admit_now("k", limits, 0)
    assert refused.reason == "concurrency"
    assert a.ticket is not None
    assert b.ticket is not None
    store.release_now(a.ticket)
    store.release_now(a.ticket)
    assert store.slots_in_use("k") == 1
    c = store.admit_now("k", limits, 0)
    assert c.allowed
    assert not store.admit_now("k", limits, 0).allowed


async def test_finish_settles_then_releases_and_is_idempotent(store: MemoryLimitStore) -> None:
    limits = Limits(tokens_per_minute=1000, max_concurrent=1)
    d = await store.admit("k", limits, 900)
    assert d.ticket is not None
    await finish(store, d.ticket, 0)
    await finish(store, d.ticket, 0)
    assert store.slots_in_use("k") == 0
    assert (await store.admit("k", limits, 1000)).allowed


def test_unlimited_key_is_admitted_without_bookkeeping(store: MemoryLimitStore) -> None:
    d = store.admit_now("k", Limits(), 10**9)
    assert d.allowed
    assert d.ticket is not None
    assert not d.ticket.accounted
    assert d.requests is None
    assert store.tracked_keys() == 0


def test_full_buckets_are_forgotten(store: MemoryLimitStore, clock: FakeClock) -> None:
    limits = Limits(requests_per_minute=60)
    for i in range(10):
        assert store.admit_now(f"k{i}", limits, 0).allowed
    assert store.tracked_keys() == 10
    clock.advance(1.0)  # every bucket has refilled its one request
    for _ in range(10):
        store.admit_now("other", limits, 0)
    assert store.tracked_keys() == 1


async def test_concurrent_burst_in_one_process_stays_within_requests_and_tokens(
    store: MemoryLimitStore,
) -> None:
    async def one(limits: Limits, cost: int) -> bool:
        d = await store.admit("burst", limits, cost)
        return d.allowed

    rpm = Limits(requests_per_minute=25, tokens_per_minute=10**6)
    results = await asyncio.gather(*(one(rpm, 10) for _ in range(200)))
    assert sum(results) == 25

    tpm = Limits(tokens_per_minute=1000)
    results = await asyncio.gather(*(one(tpm, 70) for _ in range(200)))
    assert sum(results) == 14  # 14 * 70 = 980 <= 1000 < 15 * 70
