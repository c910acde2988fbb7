"""Metrics of the learned per-backend speed (``policies.latency``) and ``predicted_latency``'s
decisions. Read at scrape time from the tracker, the pool and the running policy."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from backends.pool import BackendPool
from policies import LatencyTracker, Policy
from policies.capabilities import Capabilities
from policies.latency import IDLE_PROMPT, BackendLatency, load_of


def latency_views(tracker: LatencyTracker, pool: BackendPool) -> list[BackendLatency]:
    """What the tracker knows of each backend in the pool, at its load now."""
    now = pool.now()
    return [tracker.view(b.id, load_of(pool.snapshot(b, now), IDLE_PROMPT)) for b in pool.all()]


class LatencyCollector(Collector):
    def __init__(
        self, tracker: LatencyTracker, pool: BackendPool, policy: Callable[[], Policy]
    ) -> None:
        self._tracker = tracker
        self._pool = pool
        self._policy = policy

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        ttft = GaugeMetricFamily(
            "llm_gateway_backend_predicted_ttft_seconds",
            f"Predicted time to first token of a {IDLE_PROMPT:.0f}-token prompt on the backend "
            "as loaded now (its learned fit).",
            labels=["backend"],
        )
        itl = GaugeMetricFamily(
            "llm_gateway_backend_predicted_itl_seconds",
            "Predicted inter-token latency on the backend as loaded now (its learned fit).",
            labels=["backend"],
        )
        fit = GaugeMetricFamily(
            "llm_gateway_latency_fit",
            "The learned fits' coefficients: ttft = base + per_ktok x uncached prompt tokens / "
            "1000 + per_queued x engine queue + per_running x running + per_ktok_ahead x "
            "prompt tokens sent it awaiting their first token / 1000; itl = base + "
            "per_running x running (seconds).",
            labels=["backend", "fit", "term"],
        )
        weight = GaugeMetricFamily(
            "llm_gateway_latency_fit_weight",
            "Recent observations behind the backend's own fit (each weighs less with age; "
            "few means it is predicted much like the fleet).",
            labels=["backend"],
        )
        error = SummaryMetricFamily(
            "llm_gateway_ttft_prediction_error",
            "Absolute error of the TTFT predicted when the backend was chosen, as a share of "
            "the observed TTFT: sum / count is the mean absolute percentage error (MAPE).",
            labels=["backend"],
        )
        for v in latency_views(self._tracker, self._pool):
            ttft.add_metric([v.backend], v.idle_ttft)
            itl.add_metric([v.backend], v.itl_now)
            for term, c in v.ttft.items():
                fit.add_metric([v.backend, "ttft", term], c)
            for term, c in v.itl.items():
                fit.add_metric([v.backend, "itl", term], c)
            weight.add_metric([v.backend], v.weight)
            error.add_metric([v.backend], v.ape_n, v.ape_sum)
        yield from (ttft, itl, fit, weight, error)
        policy = Capabilities.of(self._policy()).latency_predicting
        if policy is not None:
            decisions = CounterMetricFamily(
                "llm_gateway_predicted_latency_decisions",
                "predicted_latency's decisions by the objective minimised (ttft, e2e); guarded: "
                "the load guard left a candidate out.",
                labels=["objective"],
            )
            for name in ("ttft", "e2e", "guarded"):
                decisions.add_metric([name], policy.decisions[name])
            yield decisions
