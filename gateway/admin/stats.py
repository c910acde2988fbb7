"""``GET /admin/stats``: the gateway's cumulative counters as JSON, for the console.

The same figures Prometheus scrapes from ``/admin/metrics``, read from the same registry and
regrouped for a page that diffs two polls: per backend the requests by status and the TTFT and
ITL histograms (cumulative buckets, summed over models), rate-limit rejections by key, the
admission queue (its outcomes, shedding by priority among them), the policies' decisions, the
canary split per alias, and the retry budget (extra attempts taken and refused per kind, this
replica's use of it, and whether it decides alone while Redis is out of reach). Pure: metric
families in, a document out; the handler in ``gateway.admin.api`` reads the registry.

Nothing here is per request: it runs when a console polls (once a second per open page).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Final

from prometheus_client.core import Metric

from gateway.observe.metrics import ADMISSION_QUEUE_METRIC, QUEUE_DEPTH_METRIC

HistogramBuckets = dict[float, float]


def _bucket_list(buckets: HistogramBuckets) -> list[list[float | None]]:
    """Sorted ``[le, cumulative]`` pairs; ``le`` +Inf becomes null (JSON has no infinity)."""
    return [[None if math.isinf(le) else le, n] for le, n in sorted(buckets.items())]


def _add(into: dict[str, float], key: str, value: float) -> None:
    into[key] = into.get(key, 0.0) + value


# counter sample -> (the document's field, the label it is counted by), summed over the rest
_COUNTERS: Final = {
    "llm_gateway_prefix_affinity_decisions_total": ("prefix_decisions", "reason"),
    "llm_gateway_predicted_latency_decisions_total": ("latency_decisions", "objective"),
    "llm_gateway_admission_outcomes_total": ("admission_outcomes", "outcome"),
    "llm_gateway_retries_total": ("retries", "reason"),
    "llm_gateway_stream_continuations_total": ("continuations", "outcome"),
}
_HISTOGRAMS: Final = {
    "llm_gateway_time_to_first_token_seconds_bucket": "ttft",
    "llm_gateway_inter_token_latency_seconds_bucket": "itl",
}
BUDGET_USE: Final = "llm_gateway_retry_budget_use"
BUDGET_DEGRADED: Final = "llm_gateway_retry_budget_degraded"  # only where the budget is on Redis
_GAUGES: Final = (
    QUEUE_DEPTH_METRIC,
    ADMISSION_QUEUE_METRIC,
    "llm_gateway_admission_holding",
    BUDGET_USE,
    BUDGET_DEGRADED,
)


def stats_document(families: Iterable[Metric], at: float) -> dict[str, Any]:
    """Regroup one collection of the gateway's registry; ``at`` is the wall time of it."""
    backends: dict[str, dict[str, Any]] = {}
    histograms: dict[str, dict[str, HistogramBuckets]] = {kind: {} for kind in _HISTOGRAMS.values()}
    rejections: dict[tuple[str, str], float] = {}
    aliases: dict[str, dict[str, dict[str, float]]] = {}
    counters: dict[str, dict[str, float]] = {field: {} for field, _ in _COUNTERS.values()}
    gauges: dict[str, float] = {}
    attempts: dict[str, dict[str, float]] | None = None  # kind -> outcome -> count

    def backend(bid: str) -> dict[str, Any]:
        return backends.setdefault(bid, {"requests": {}})

    for family in families:
        for s in family.samples:
            name, labels, value = s.name, s.labels, s.value
            if name == "llm_gateway_requests_total":
                _add(backend(labels["backend"])["requests"], labels["status"], value)
            elif name in _HISTOGRAMS:
                per = histograms[_HISTOGRAMS[name]].setdefault(labels["backend"], {})
                le = float(labels["le"])
                per[le] = per.get(le, 0.0) + value
            elif name in _COUNTERS:
                field, label = _COUNTERS[name]
                _add(counters[field], labels[label], value)
            elif name == "llm_gateway_rate_limit_rejections_total":
                k = (labels["key"], labels["reason"])
                rejections[k] = rejections.get(k, 0.0) + value
            elif name == "llm_gateway_pool_requests_total":
                pools = aliases.setdefault(labels["alias"], {})
                _add(pools.setdefault(labels["pool"], {}), labels["status"], value)
            elif name in _GAUGES:
                gauges[name] = value
            elif name == "llm_gateway_retry_budget_attempts_total":
                attempts = {} if attempts is None else attempts
                _add(attempts.setdefault(labels["kind"], {}), labels["outcome"], value)
    for kind, per_backend in histograms.items():
        for bid, buckets in per_backend.items():
            backend(bid)[kind] = _bucket_list(buckets)
    return {
        "at": at,
        "backends": backends,
        "rate_limit_rejections": [
            {"key": k, "reason": r, "count": n} for (k, r), n in sorted(rejections.items())
        ],
        "admission": {
            "waiting": gauges.get(ADMISSION_QUEUE_METRIC, 0.0),
            "holding": gauges.get("llm_gateway_admission_holding", 0.0),
            "outcomes": counters.pop("admission_outcomes"),
        },
        "retry_budget": None if attempts is None else _retry_budget(attempts, gauges),
        "queue_depth": gauges.get(QUEUE_DEPTH_METRIC, 0.0),
        "aliases": aliases,
        **counters,
    }


def _retry_budget(
    attempts: dict[str, dict[str, float]], gauges: dict[str, float]
) -> dict[str, Any]:
    """The budget of extra attempts: per kind taken and refused; ``use``, this replica's extra
    attempts over the window as a share of what its own requests allow; ``shared``, whether it
    is the fleet's on Redis; ``degraded``, whether this replica decides alone meanwhile."""
    shared = BUDGET_DEGRADED in gauges
    return {
        "attempts": attempts,
        "use": gauges.get(BUDGET_USE),
        "shared": shared,
        "degraded": shared and gauges[BUDGET_DEGRADED] > 0,
    }
