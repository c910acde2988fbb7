"""The one budget of extra attempts: its arithmetic with given times, what the request path
does when it is spent, and one budget for replicas that share a Redis."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import aiohttp
import pytest
from redis.asyncio import Redis

from backends.upstream.mock import MockRequest, MockResponse, MockTransport
from gateway.limits.retry_budget import LocalBudget, RetryBudgetPolicy, Window, allows
from gateway.limits.retry_budget_redis import RedisBudget
from tests.helpers import running_gateway, sample
from tests.mock_fleet import Fleet, InOrder, chunk
from tests.redis_proxy import holding_proxy


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_extra_attempts_are_a_share_of_the_requests_plus_a_floor() -> None:
    policy = RetryBudgetPolicy(ratio=0.1, min_per_second=0.5, window=10)
    assert allows(policy, requests=100, extras=14)  # 15 <= 10 + 5
    assert not allows(policy, requests=100, extras=15)
    assert allows(policy, requests=0, extras=4)  # a quiet fleet still retries a little
    assert not allows(RetryBudgetPolicy(ratio=0, min_per_second=0), requests=1000, extras=0)


def test_the_window_forgets_what_is_older_and_stays_small() -> None:
    window = Window(10)
    for t in range(100):
        window.add(float(t))
    assert window.total(99.0) == 10
    assert window.total(120.0) == 0
    assert len(window._buckets) <= 12


async def test_a_local_budget_refuses_once_spent_and_recovers_with_time() -> None:
    clock = Clock()
    budget = LocalBudget(RetryBudgetPolicy(ratio=0.5, min_per_second=0, window=10), clock)
    for _ in range(4):
        budget.deposit()
    assert [await budget.take("retry") for _ in range(3)] == [True, True, False]
    assert await budget.take("hedge") is False
    assert (budget.taken["retry"], budget.refused["retry"], budget.refused["hedge"]) == (2, 1, 1)
    clock.t += 11  # the window moved on: nothing deposited, nothing taken
    assert await budget.take("continuation") is False
    budget.deposit()
    budget.deposit()
    assert await budget.take("continuation") is True


def refusing(_request: MockRequest) -> MockResponse:
    return MockResponse.json({"error": {"message": "full"}}, 503)


async def streaming(_request: MockRequest) -> MockResponse:
    async def body():  # type: ignore[no-untyped-def]
        yield chunk({"choices": [{"index": 0, "delta": {"content": "ok"}}]})
        yield b"data: [DONE]\n\n"

    return MockResponse.sse(body())


BACKENDS = [{"url": f"http://{n}.invalid:8000", "name": n} for n in ("a", "b")]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def refused_backend_then_good(budget: dict[str, float]) -> tuple[int, list[str], float]:
    async def refused(request: MockRequest) -> MockResponse:
        return refusing(request)

    transport = MockTransport(Fleet({"a": refused, "b": streaming}))
    retry = {"backoff_base": 0, **budget}
    async with running_gateway(BACKENDS, transport=transport, retry=retry) as gw:
        gw.svc.router.policy = InOrder()
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw.url + "/v1/chat/completions", json=CHAT) as r,
        ):
            await r.read()
            refused_n = sample(
                gw, "llm_gateway_retry_budget_attempts_total", kind="retry", outcome="refused"
            )
            return r.status, [q.backend.id for q in transport.requests], refused_n


async def test_a_retry_the_budget_refuses_fails_as_without_it() -> None:
    status, tried, refused = await refused_backend_then_good(
        {"budget_ratio": 0, "budget_min_per_second": 0}
    )
    assert (status, tried, refused) == (503, ["a"], 1)  # a's own "not now", as it gave it


async def test_a_retry_within_the_budget_goes_to_the_next_backend() -> None:
    status, tried, refused = await refused_backend_then_good({})
    assert (status, tried, refused) == (200, ["a", "b"], 0)


async def test_three_replicas_sharing_a_redis_share_one_budget(
    redis_url: str, redis_prefix: str
) -> None:
    """Each replica's requests count for all: 30 requests at 0.1 allow 3 extra attempts in all,
    not 3 each, whichever replica asks."""
    policy = RetryBudgetPolicy(ratio=0.1, min_per_second=0, window=30)
    clients = [Redis.from_url(redis_url) for _ in range(3)]
    clock = Clock()
    replicas = [RedisBudget(c, policy, key_prefix=redis_prefix, clock=clock) for c in clients]
    try:
        for budget in replicas:
            for _ in range(10):
                budget.deposit()
            await budget.flush()
        taken = [await replicas[i % 3].take("retry") for i in range(6)]
        assert taken == [True, True, True, False, False, False]
        assert sum(b.taken["retry"] for b in replicas) == 3
        assert not any(b.degraded for b in replicas)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))


async def test_requests_whose_answer_redis_held_are_counted_once_when_sent_again(
    redis_url: str, redis_prefix: str
) -> None:
    """A flush times out while its write lands (Redis paused or slow, its answer late): sent
    again once Redis answers, it is not added twice (that would fund extra attempts that no
    request paid for)."""
    policy = RetryBudgetPolicy(ratio=0.1, min_per_second=0, window=30)
    port = urlsplit(redis_url).port
    assert port is not None
    direct = Redis.from_url(redis_url)

    async def requests_counted() -> int:
        keys = [k async for k in direct.scan_iter(redis_prefix + "retry-budget:r:*")]
        return sum(int(v) for v in await direct.mget(keys)) if keys else 0

    async with holding_proxy(port) as proxy:
        client = Redis.from_url(proxy.url)
        budget = RedisBudget(client, policy, key_prefix=redis_prefix, clock=Clock(), timeout=0.02)
        try:
            for _ in range(10):
                budget.deposit()
            await client.ping()  # connected: the batch itself is what goes unanswered
            proxy.hold()
            await budget.flush()  # no answer: it may have landed, or not
            assert budget.degraded
            deadline = asyncio.get_running_loop().time() + 5
            while await requests_counted() != 10:  # it did land
                assert asyncio.get_running_loop().time() < deadline, "the write never landed"
                await asyncio.sleep(0.01)  # sleep-ok: polling interval of a deadline-bounded wait
            proxy.release()
            budget.deposit()
            await budget.flush()  # the held batch again: the new request waits for the next
            assert not budget.degraded
            await budget.flush()
            assert await requests_counted() == 11
            assert [await budget.take("retry") for _ in range(2)] == [True, False]
        finally:
            await client.aclose()
            await direct.aclose()


async def test_without_redis_each_replica_decides_on_its_own_and_says_so() -> None:
    policy = RetryBudgetPolicy(ratio=0.5, min_per_second=0, window=10)
    client = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.05)
    budget = RedisBudget(client, policy, key_prefix="none:", clock=Clock())
    try:
        for _ in range(2):
            budget.deposit()
        await budget.flush()  # fails: the two stay to be added later
        assert budget.degraded
        assert [await budget.take("retry") for _ in range(2)] == [True, False]
        assert budget.degraded_decisions == 2
    finally:
        await client.aclose()


@pytest.mark.parametrize("bad", [{"budget_ratio": -1}, {"budget_window": 0}])
async def test_a_budget_out_of_bounds_is_refused_at_start(bad: dict[str, float]) -> None:
    from pydantic import ValidationError

    from gateway.config.settings import Settings

    with pytest.raises(ValidationError, match="budget"):
        Settings(retry=bad)


async def test_a_broken_stream_is_continued_only_within_the_budget() -> None:
    async def cut(_request: MockRequest) -> MockResponse:
        async def body():  # type: ignore[no-untyped-def]
            yield chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            yield chunk({"choices": [{"index": 0, "delta": {"content": "t0"}}]})
            raise ConnectionResetError("the backend died")

        return MockResponse.sse(body())

    outcomes = {}
    for name, budget in (("spent", {"budget_ratio": 0, "budget_min_per_second": 0}), ("ok", {})):
        transport = MockTransport(Fleet({"a": cut, "b": streaming}))
        retry = {"backoff_base": 0, **budget}
        async with running_gateway(BACKENDS, transport=transport, retry=retry) as gw:
            gw.svc.router.policy = InOrder()
            async with (
                aiohttp.ClientSession() as s,
                s.post(gw.url + "/v1/chat/completions", json=CHAT) as r,
            ):
                await r.read()
            outcomes[name] = (
                [q.backend.id for q in transport.requests],
                sample(
                    gw,
                    "llm_gateway_retry_budget_attempts_total",
                    kind="continuation",
                    outcome="refused",
                ),
            )
    assert outcomes["spent"] == (["a"], 1)  # ended as it broke: no second backend asked
    assert outcomes["ok"][0][:2] == ["a", "b"]  # continued on b
    assert outcomes["ok"][1] == 0
