"""``llm-gateway top``'s line on the retry budget (whose it is, this replica's use, per kind the
extra attempts taken and refused, degraded while Redis is out of reach) and the requests the
admission queue shed: from the Prometheus text a gateway's registry writes, and against a
gateway that took and was refused retries and shed a request for real."""

from __future__ import annotations

import io

from prometheus_client import generate_latest
from redis.asyncio import Redis
from rich.console import Console

from gateway.limits.retry_budget import LocalBudget, RetryBudgetPolicy
from gateway.limits.retry_budget_redis import RedisBudget
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.retry_budget_metrics import RetryBudgetCollector
from tests import budget_and_shed
from tests.helpers import gateway_for
from tools.top import TopClient, limits_line, parse_metrics

TOKEN = "top-budget-secret"
POLICY = RetryBudgetPolicy(ratio=0.5, min_per_second=0, window=10)


def shown(renderable: object) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(renderable)
    return out.getvalue()


def scraped(budget: LocalBudget | RedisBudget) -> str:
    """``/admin/metrics`` of a registry holding ``budget``'s collector."""
    m = GatewayMetrics()
    m.registry.register(RetryBudgetCollector(lambda: budget))
    return generate_latest(m.registry).decode()


async def test_a_budget_of_its_own_says_so_with_each_kinds_taken_and_refused() -> None:
    budget = LocalBudget(POLICY, clock=lambda: 0.0)
    for _ in range(4):
        budget.deposit()
    assert [await budget.take("retry") for _ in range(3)] == [True, True, False]
    assert await budget.take("continuation") is False
    line = limits_line(parse_metrics(scraped(budget), 1.0))
    assert line is not None
    assert line.plain == (
        "retry budget (this gateway's own): 100% used · retry 2 taken, 1 refused · "
        "hedge 0 taken, 0 refused · continuation 0 taken, 1 refused"
    )


async def test_a_shared_budget_says_whose_and_when_the_replica_decides_alone() -> None:
    client = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.05)
    budget = RedisBudget(client, POLICY, key_prefix="none:", clock=lambda: 0.0)
    try:
        line = limits_line(parse_metrics(scraped(budget), 1.0))
        assert line is not None
        assert line.plain.startswith("retry budget (the fleet's, on Redis): 0% of this replica")
        budget.deposit()
        await budget.flush()  # Redis out of reach
        line = limits_line(parse_metrics(scraped(budget), 2.0))
        assert line is not None
        assert line.plain.startswith(
            "retry budget: DEGRADED, Redis out of reach: this replica decides alone, 0% of its"
        )
        assert any("yellow" in str(span.style) for span in line.spans)
    finally:
        await client.aclose()


def test_nothing_said_by_a_gateway_that_says_neither() -> None:
    text = 'llm_gateway_requests_total{backend="a",status="200"} 3\n'
    sample = parse_metrics(text, 1.0)
    assert (sample.budget, sample.shed, sample.requests) == (None, None, {"a": 3.0})
    assert limits_line(sample) is None


async def test_top_shows_the_retries_taken_and_refused_and_the_request_shed_live() -> None:
    a, b = budget_and_shed.backends()
    settings = {**budget_and_shed.SETTINGS, "admin": {"token": TOKEN}}
    async with gateway_for(a, b, names=budget_and_shed.NAMES, **settings) as (gw, s):
        assert gw.admin_url is not None
        statuses = await budget_and_shed.retried(s, gw.url)
        retried = len(a.seen) + len(b.seen) - sum(statuses.values())  # beyond first attempts
        await budget_and_shed.shed_one(s, gw.url, gw.svc, a, b)
        text = shown(await TopClient(s, gw.admin_url, TOKEN).next_frame())
    assert f"retry {retried} taken, {statuses[503]} refused" in text
    assert retried >= 1
    assert statuses[503] >= 1
    assert "retry budget (this gateway's own): " in text
    assert "admission queue: 1 shed" in text
