"""Reads the load figures the router needs out of vLLM's Prometheus text. Pure, no I/O.

Only three families matter for routing, so instead of building every family (vLLM's page is
mostly histogram buckets) one anchored regular expression picks the few lines we need.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Final

_LINE: Final = re.compile(
    r"^vllm:(num_requests_waiting|num_requests_running|kv_cache_usage_perc|gpu_cache_usage_perc"
    r"|engine_sleep_state)(\{[^\n]*\})?[ \t]+(\S+)",
    re.MULTILINE,
)


@dataclass(frozen=True, slots=True)
class LoadReading:
    """One scrape's figures, summed over the model names the server reports."""

    waiting: int
    running: int
    kv_cache_usage: float | None
    # vllm:engine_sleep_state: True when a state other than "awake" is the one set (weights
    # offloaded, or all discarded); None if the server does not export it
    asleep: bool | None = None


class MetricsFormatError(ValueError):
    """The page does not carry vLLM's load gauges (or carries nonsense in them)."""


def parse_load(text: str) -> LoadReading:
    """Extract waiting, running and KV-cache usage; raise ``MetricsFormatError`` if absent."""
    waiting = running = 0.0
    kv: float | None = None
    legacy_kv: float | None = None
    seen = False
    asleep: bool | None = None
    for match in _LINE.finditer(text):
        name, labels, raw = match.group(1), match.group(2) or "", match.group(3)
        try:
            value = float(raw)
        except ValueError as exc:
            raise MetricsFormatError(f"bad value {raw!r} for vllm:{name}") from exc
        if not math.isfinite(value) or value < 0:
            raise MetricsFormatError(f"bad value {raw!r} for vllm:{name}")
        if name == "engine_sleep_state":
            if value > 0:
                asleep = bool(asleep) or 'sleep_state="awake"' not in labels
            elif asleep is None:
                asleep = False
        elif name == "num_requests_waiting":
            waiting += value
            seen = True
        elif name == "num_requests_running":
            running += value
            seen = True
        elif name == "kv_cache_usage_perc":
            kv = value if kv is None else max(kv, value)
        else:  # gpu_cache_usage_perc, the name before vLLM 0.9
            legacy_kv = value if legacy_kv is None else max(legacy_kv, value)
    if not seen:
        raise MetricsFormatError("no vllm:num_requests_waiting/running gauges in /metrics")
    usage = kv if kv is not None else legacy_kv
    if usage is not None:
        usage = min(usage, 1.0)
    return LoadReading(
        waiting=int(waiting), running=int(running), kv_cache_usage=usage, asleep=asleep
    )
