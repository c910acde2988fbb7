"""One backend's mutable state. Only the pool mutates it, from the event loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.vllm_metrics import LoadReading


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """What configuration says about a backend."""

    id: str
    url: str
    api_key: str | None = None


@dataclass(slots=True)
class BackendState:
    spec: BackendSpec
    models: frozenset[str] = frozenset()
    models_known: bool = False
    reachable: bool = False
    in_flight: int = 0
    sent_total: int = 0
    # sent_total when the newest successful scrape began: what was sent after it is invisible
    # to that scrape's figures.
    sent_at_scrape: int = 0
    load: LoadReading | None = None
    load_at: float = field(default=float("-inf"))

    @property
    def id(self) -> str:
        return self.spec.id
