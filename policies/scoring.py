"""The load score shared by ``least_load`` and ``power_of_two``: lower is less loaded."""

from __future__ import annotations

from dataclasses import dataclass

from policies.setting import check_settings, setting
from policies.types import BackendSnapshot


@dataclass(frozen=True, slots=True)
class Weights:
    """Weights of each load signal in the score; ops tune them live."""

    active: float = setting(2.0, "score weight of each request in flight", ge=0)
    queue: float = setting(3.0, "score weight of each request queued in the engine", ge=0)
    kv: float = setting(0.0, "score weight of the engine's KV-cache usage (0..1)", ge=0)

    def __post_init__(self) -> None:
        check_settings(self)


def effective_queue(snap: BackendSnapshot) -> int:
    """Scraped queue depth plus what the gateway sent since that scrape began.

    Those requests are invisible to the scrape and may well be waiting in the engine, so a
    burst does not pile onto a backend that looked idle a moment ago. Without a fresh scrape
    the queue term is zero and the score rests on the gateway's own in-flight count.
    """
    if snap.queue_depth is None:
        return 0
    return snap.queue_depth + snap.sent_since_scrape


def score(snap: BackendSnapshot, weights: Weights) -> float:
    """w_active x in-flight + w_queue x queue depth + w_kv x KV-cache usage (0..1)."""
    kv = snap.kv_cache_usage if snap.kv_cache_usage is not None else 0.0
    return weights.active * snap.in_flight + weights.queue * effective_queue(snap) + weights.kv * kv
