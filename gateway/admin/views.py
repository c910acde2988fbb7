"""What the admin API shows of a backend: its state and what the latency tracker learned."""

from __future__ import annotations

from typing import Any

from backends.state import BackendState
from policies import score
from policies.latency import BackendLatency


def backend_view(
    b: BackendState, now: float, snapshot: Any = None, weights: Any = None
) -> dict[str, object]:
    load = b.load
    return {
        "score": None if snapshot is None or weights is None else score(snapshot, weights),
        "id": b.id,
        "url": b.spec.url,
        "source": b.spec.source,
        "health": b.health.state.value,
        "health_error": b.health.last_error,
        "circuit": b.circuit.state.value,
        "draining": b.draining,
        "removed": b.removed,
        "models": sorted(b.models),
        # the host's (every worker's, ``serve --workers``) when the snapshot is at hand
        "in_flight": b.in_flight if snapshot is None else snapshot.in_flight,
        "queue_depth": load.waiting if load else None,
        "running": load.running if load else None,
        "kv_cache_usage": load.kv_cache_usage if load else None,
        "scrape_age_s": None if load is None else round(now - b.load_at, 3),
    }


def latency_view(v: BackendLatency) -> dict[str, object]:
    """What the latency tracker learned of one backend (``policies.latency``)."""
    return {
        "predicted_ttft_s": round(v.idle_ttft, 6),
        "predicted_itl_s": round(v.itl_now, 6),
        "ttft_fit": {k: round(c, 6) for k, c in v.ttft.items()},
        "itl_fit": {k: round(c, 6) for k, c in v.itl.items()},
        "weight": round(v.weight, 3),
        "observed": v.observed,
        "last_ttft_s": v.last_ttft,
        "ttft_mape": None if v.mape is None else round(v.mape, 4),
    }
