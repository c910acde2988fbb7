"""Engine statistics as plain numbers: updated on the hot path, rendered at scrape time.

Bucket bounds are vLLM V1's, so dashboards built for vLLM read the simulator's
histograms the same way.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

FINISH_REASONS: Final = ("stop", "length", "abort", "error", "repetition")
ABORT_PHASES: Final = ("queued", "transfer", "prefill", "decode")


class Histogram:
    """Bucket counts and a sum; ``observe`` is a bisect and two additions."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs, +Inf last, as Prometheus exposes them."""
        out: list[tuple[str, int]] = []
        total = 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


@dataclass(slots=True)
class EngineStats:
    """Counters and histograms the engine keeps; names follow the vLLM metrics."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    kv_transfers: int = 0  # remote prefills whose KV this (decode) instance received
    kv_transfer_tokens: int = 0
    steps: int = 0
    busy_time: float = 0.0  # simulated seconds spent in steps
    request_success: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0)
    )
    aborted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ABORT_PHASES, 0))
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    prefill_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    decode_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
