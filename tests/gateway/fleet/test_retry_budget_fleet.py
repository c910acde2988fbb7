"""The retry budget of three real replicas sharing a Redis (``gateway.limits.retry_budget_redis``):
one budget for the fleet, not one per replica; each replica's own while Redis is paused, and
the fleet's again once it answers.

Backends ``a`` and ``b`` refuse every request (503, their circuits kept closed so that they go
on being picked), ``c`` answers: a request first sent to ``a`` or ``b`` wants a retry or two,
which the budget grants or refuses (then the client gets the backend's 503). The budget has no
floor (``budget_min_per_second = 0``), so what it allows is ``budget_ratio`` x the requests in
the window (longer than the test: nothing ages out).

Without a floor, three separate budgets would allow as much in total as one when every replica
gets the same share of the load, so the load here is uneven: one replica takes the requests
that need no retry (all backends answering), the two others those that do. Budgets of their
own would give those two ratio x their own requests; the fleet's gives them ratio x all.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from gateway.limits.retry_budget import LocalBudget, RetryBudgetPolicy
from tests.gateway.fleet.replicas import Fleet, Replica, chat, poll, running_fleet
from tests.redis_server import RedisServer
from tools.fake_vllm import answer, echo_json

pytestmark = pytest.mark.timeout(120)

RATIO: Final = 0.2
POLICY: Final = RetryBudgetPolicy(ratio=RATIO, min_per_second=0.0, window=600.0)
RETRY: Final[dict[str, object]] = {
    "budget_ratio": POLICY.ratio,
    "budget_min_per_second": POLICY.min_per_second,
    "budget_window": POLICY.window,
    "backoff_base": 0.0,  # retried at once: the test is about how many, not when
}
# 503s open a circuit after `circuit_threshold` in a row: kept closed, the refusing backends
# stay candidates and every request first sent to one of them asks for a retry
HEALTH: Final[dict[str, object]] = {"circuit_threshold": 1_000_000}
REFUSAL: Final = "refused by the test"
FLEET_NAME: Final = "default"  # replicas.py's fleets keep the default name


def allowance(requests: int) -> int:
    """The extra attempts one budget allows after ``requests`` requests in its window: one
    replica alone with all of them (the project's own arithmetic, ``LocalBudget``)."""
    budget = LocalBudget(POLICY, clock=lambda: 0.0)
    for _ in range(requests):
        budget.deposit()
    taken = 0
    while budget.take_now("retry"):
        taken += 1
    return taken


@dataclass(frozen=True, slots=True)
class Figures:
    """One replica's retry budget as its ``/metrics`` says."""

    attempts: Counter[tuple[str, str]]  # (kind, outcome) -> count
    degraded: float

    def taken(self, kind: str = "retry") -> int:
        return int(self.attempts[kind, "taken"])

    def refused(self, kind: str = "retry") -> int:
        return int(self.attempts[kind, "refused"])


async def figures(fleet: Fleet, replica: Replica) -> Figures:
    async with fleet.session.get(replica.url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    attempts: Counter[tuple[str, str]] = Counter()
    degraded = -1.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "llm_gateway_retry_budget_attempts_total":
                attempts[s.labels["kind"], s.labels["outcome"]] += int(s.value)
            elif s.name == "llm_gateway_retry_budget_degraded":
                degraded = s.value
    return Figures(attempts, degraded)


async def everyone(fleet: Fleet) -> list[Figures]:
    return [await figures(fleet, r) for r in fleet]


async def send(fleet: Fleet, replica: Replica, n: int) -> Counter[int]:
    """``n`` chat requests through ``replica``, one after another: their statuses. A refusal
    the client gets is the backend's own, passed on (never one the gateway made up)."""
    statuses: Counter[int] = Counter()
    for _ in range(n):
        async with fleet.session.post(replica.url + "/v1/chat/completions", json=chat()) as r:
            body = await r.text()
            assert r.status in (200, 503), body
            if r.status == 503:
                assert REFUSAL in body, body
            statuses[r.status] += 1
    return statuses


def attempts_seen(fleet: Fleet) -> dict[str, int]:
    return {name: len(fake.seen) for name, fake in fleet.fakes.items()}


def refuse(fleet: Fleet, refusing: bool) -> None:
    for name in "ab":
        fleet.fakes[name].behaviour = answer(503, REFUSAL) if refusing else echo_json


async def counted(redis: Redis, prefix: str) -> tuple[int, int]:
    """The fleet's requests and extra attempts in the window, as Redis holds them."""
    totals = []
    for what in ("r", "x"):
        keys = [k async for k in redis.scan_iter(f"{prefix}{FLEET_NAME}:retry-budget:{what}:*")]
        totals.append(sum(int(v) for v in await redis.mget(keys)) if keys else 0)
    return totals[0], totals[1]


async def flushed(redis: Redis, prefix: str, requests: int) -> tuple[int, int]:
    """Redis's counts once every replica has added its requests (each adds its own every
    half-second): exactly ``requests`` of them, never more."""
    got = await poll(
        lambda: counted(redis, prefix),
        lambda c: c[0] >= requests,
        what=f"{requests} requests counted on Redis",
    )
    assert got[0] == requests, f"requests counted twice on Redis: {got[0]} for {requests}"
    return got


async def test_three_replicas_draw_on_one_budget_never_more_than_its_ratio(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """90 requests through r0 that need no retry, then 60 through r1 and r2 that want one or
    two each: the fleet takes at most ratio x 150 = 30 retries (what one replica alone with
    all 150 would allow), more than the 12 that r1's and r2's own 60 would fund; each retry
    the metrics count is an attempt a refusing backend received."""
    funded, failing = 90, 60
    async with (
        running_fleet(tmp_path, redis_url, redis_prefix, retry=RETRY, health=HEALTH) as fleet,
        Redis.from_url(redis_url) as redis,
    ):
        r0, r1, r2 = fleet
        assert await send(fleet, r0, funded) == {200: funded}
        assert await flushed(redis, redis_prefix, funded) == (funded, 0)

        refuse(fleet, True)
        before = attempts_seen(fleet)
        statuses: Counter[int] = Counter()
        for replica in itertools.islice(itertools.cycle((r1, r2)), failing):
            statuses += await send(fleet, replica, 1)
        seen = {name: n - before[name] for name, n in attempts_seen(fleet).items()}
        requests, extras = await flushed(redis, redis_prefix, funded + failing)

        got = await everyone(fleet)
        taken = sum(f.taken() for f in got)
        refused = sum(f.refused() for f in got)
        # Every decision the fleet's (a Redis call slower than the budget's timeout would
        # have left it to the replica alone, and the bounds below would not hold)
        for r in fleet:
            assert not r.events("retry_budget_degraded"), r.name
        # The two counts of the retries made agree: the replicas' and the backends'.
        assert sum(seen.values()) - failing == taken == extras
        assert seen["c"] == statuses[200]  # c answers all it gets; a and b refuse all theirs
        assert got[0].taken() == got[0].refused() == 0  # r0's requests needed none
        assert all(f.taken(k) == f.refused(k) == 0 for f in got for k in ("hedge", "continuation"))
        assert all(f.degraded == 0 for f in got)
        # Asked for more than the budget holds: it was the limit, and it held for the fleet.
        assert refused > 0, (taken, refused)
        assert taken <= allowance(requests) == 30
        # One budget, not three: r1 and r2 took retries r0's requests paid for; their own
        # budgets (ratio x 30 each) would have stopped at 12. The flush's lag hides from a
        # replica the others' requests of the last half-second, never its own nor any extra
        # attempt (each one atomic on Redis): it can only withhold, and not r0's 90, on Redis
        # before the first retry: a refusal means at least 18 taken by then.
        assert taken > allowance(failing // 2) * 2 == 12
        assert taken >= allowance(funded) == 18


async def test_redis_paused_each_replica_decides_alone_then_the_fleet_again(
    tmp_path: Path, own_redis: RedisServer, redis_prefix: str
) -> None:
    """Redis paused: every replica says it is degraded and goes on serving; r1, with only its
    own requests to go on, allows ratio x its own (7 for 35) while r0, funded by 85 of its own,
    takes more than that. Redis resumed: every replica back to the fleet's budget (degraded
    0), its requests counted there once, none lost or doubled."""
    funded, each, failing = 50, 5, 30
    async with (
        running_fleet(tmp_path, own_redis.url, redis_prefix, retry=RETRY, health=HEALTH) as fleet,
        Redis.from_url(own_redis.url) as redis,
    ):
        r0, r1, _ = fleet
        assert await send(fleet, r0, funded) == {200: funded}
        assert await flushed(redis, redis_prefix, funded) == (funded, 0)

        own_redis.pause()
        try:
            for r in fleet:  # served while Redis does not answer
                assert await send(fleet, r, each) == {200: each}
            await poll(
                lambda: everyone(fleet),
                lambda got: [f.degraded for f in got] == [1.0] * 3,
                what="every replica degraded",
            )
            refuse(fleet, True)
            before = attempts_seen(fleet)
            own = await send(fleet, r1, failing)
            alone = await figures(fleet, r1)
            funded_own = await send(fleet, r0, failing)
            seen = {name: n - before[name] for name, n in attempts_seen(fleet).items()}
            got = await everyone(fleet)
        finally:
            own_redis.resume()
        assert seen["c"] == own[200] + funded_own[200]
        # r1 alone: ratio x its own 35 requests, though the fleet's window held 95 by then.
        assert alone.taken() <= allowance(each + failing) == 7
        assert alone.refused() > 0
        # r0 alone: ratio x its own 85, more than r1's could allow.
        assert got[0].taken() > allowance(each + failing)
        assert got[0].taken() <= allowance(funded + each + failing) == 17
        assert sum(seen.values()) - 2 * failing == sum(f.taken() for f in got)
        assert got[2].taken() == got[2].refused() == 0

        await poll(
            lambda: everyone(fleet),
            lambda got: [f.degraded for f in got] == [0.0] * 3,
            what="every replica back on the fleet's budget",
        )
        # Every request counted once on Redis, those of the outage included.
        await flushed(redis, redis_prefix, funded + 3 * each + 2 * failing)
    for r in fleet:
        assert len(r.events("retry_budget_degraded")) == 1, r.name  # one line per outage
        assert len(r.events("retry_budget_restored")) == 1, r.name
