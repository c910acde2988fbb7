"""A backend's Prometheus page, reduced to the few totals a load test reports. Pure."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Final

# Families a scenario reports per backend, summed over their label sets.
FAMILIES: Final = (
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sim:aborted_requests_total",
    "sim:injected_errors_total",
    "sim:clock_lag_seconds",
)
# The gateway's own page (gateway/observe/metrics.py), for the other side of a scenario.
GATEWAY_FAMILIES: Final = (
    "llm_gateway_requests_total",
    "llm_gateway_retries_total",
    "llm_gateway_rescues_declined_total",
    "llm_gateway_hedges_total",
    "llm_gateway_failovers_total",
    "llm_gateway_upstream_aborts_total",
    "llm_gateway_stream_continuations_total",
    "llm_gateway_backend_stalls_total",
    "llm_gateway_disagg_prefill_seconds_sum",
    "llm_gateway_disagg_prefill_seconds_count",
    "llm_gateway_disagg_decode_first_token_seconds_sum",
    "llm_gateway_disagg_decode_first_token_seconds_count",
    # The latency tracker's TTFT predictions: sum / count is their MAPE.
    "llm_gateway_ttft_prediction_error_sum",
    "llm_gateway_ttft_prediction_error_count",
)
_GAUGES: Final = frozenset(
    {"vllm:num_requests_running", "vllm:num_requests_waiting", "sim:clock_lag_seconds"}
)
_LINE: Final = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?[ \t]+(\S+)", re.MULTILINE)


def totals(text: str, families: tuple[str, ...] = FAMILIES) -> dict[str, float]:
    """Each wanted family's value summed over its label sets (absent families are left out)."""
    wanted = set(families)
    out: dict[str, float] = {}
    for m in _LINE.finditer(text):
        name = m.group(1)
        if name in wanted:
            try:
                value = float(m.group(2))
            except ValueError:
                continue
            if not math.isnan(value):
                out[name] = out.get(name, 0.0) + value
    return out


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Counters as after - before; gauges as their value after."""
    out: dict[str, float] = {}
    for name, value in after.items():
        out[name] = value if name in _GAUGES else value - before.get(name, 0.0)
    hits, queries = (
        out.get("vllm:prefix_cache_hits_total"),
        out.get("vllm:prefix_cache_queries_total"),
    )
    if hits is not None and queries:
        out["prefix_cache_hit_rate"] = hits / queries
    return out
