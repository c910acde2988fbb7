"""The retry budget's metrics (``gateway.limits.retry_budget``), read when scraped."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.limits.retry_budget import KINDS, LocalBudget
from gateway.limits.retry_budget_redis import RedisBudget


class RetryBudgetCollector(Collector):
    def __init__(self, budget: Callable[[], LocalBudget | RedisBudget | None]) -> None:
        self._budget = budget

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        budget = self._budget()
        if budget is None:
            return
        attempts = CounterMetricFamily(
            "llm_gateway_retry_budget_attempts",
            "Extra attempts asked of the retry budget, by kind (retry, hedge, continuation) and "
            "outcome: taken, or refused (the request then fails as it would have without it).",
            labels=["kind", "outcome"],
        )
        for kind in KINDS:
            attempts.add_metric([kind, "taken"], budget.taken[kind])
            attempts.add_metric([kind, "refused"], budget.refused[kind])
        yield attempts
        local = budget.local if isinstance(budget, RedisBudget) else budget
        requests, extras = local.use()
        p = local.policy
        use = GaugeMetricFamily(
            "llm_gateway_retry_budget_use",
            "This replica's extra attempts over the window, as a share of what its own requests "
            "allow (the fleet's budget is on Redis when shared).",
        )
        use.add_metric([], extras / max(p.ratio * requests + p.min_per_second * p.window, 1e-9))
        yield use
        if isinstance(budget, RedisBudget):
            yield GaugeMetricFamily(
                "llm_gateway_retry_budget_degraded",
                "1 while Redis is out of reach and this replica's own budget decides.",
                value=1.0 if budget.degraded else 0.0,
            )
