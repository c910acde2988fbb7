"""The load score shared by ``least_load`` and ``power_of_two``: lower is less loaded."""

from __future__ import annotations

from policies.types import BackendSnapshot, Weights

__all__ = ["Weights", "effective_queue", "score"]  # Weights: its home is the contract


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
