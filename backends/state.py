"""One backend's mutable state. Only the pool mutates it, from the event loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from backends.circuit import CircuitBreaker, CircuitPolicy
from backends.health import Health, HealthPolicy, HealthTracker
from backends.sleep import Rest, rest_of
from backends.vllm_metrics import LoadReading


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """What configuration (or discovery) says about a backend."""

    id: str
    url: str
    api_key: str | None = None
    source: str = "static"  # "static", or the DNS name it was discovered under
    # "prefill"/"decode": one half of disaggregated serving (gateway.request.disagg); "both": either
    role: Literal["both", "prefill", "decode"] = "both"
    # vLLM's --scheduling-policy: "priority" engines get each request's priority
    # (``gateway.request.priority``); under "fcfs" (vLLM's default) it would be ignored
    scheduling: Literal["fcfs", "priority"] = "fcfs"


@dataclass(slots=True)
class BackendState:
    spec: BackendSpec
    health: HealthTracker = field(default_factory=lambda: HealthTracker(HealthPolicy()))
    circuit: CircuitBreaker = field(default_factory=lambda: CircuitBreaker(CircuitPolicy()))
    models: frozenset[str] = frozenset()
    models_known: bool = False
    # Endpoints (``gateway.request.endpoints`` names) it answered with "no such route": a generation
    # server asked to embed, a pooling one asked to chat. Forgotten when it comes back up or
    # its models change (it may have been restarted as the other kind).
    lacks: frozenset[str] = frozenset()
    draining: bool = False
    # Sleep (``backends.sleep``): whether the fleet wants it asleep (the capacity manager's, or
    # an operator's, through the fleet's log), and whether it was last seen asleep (its
    # ``/is_sleeping``, or its sleep-state gauge; None: not known, taken as awake). Either one
    # keeps new requests off it: a sleeping engine queues what it is sent until woken.
    sleep_wanted: bool = False
    asleep: bool | None = None
    resting: bool = False  # sleep_wanted or asleep: kept by the pool, read by ``routable``
    rest_since: float = 0.0  # when its rest last changed (the pool's clock)
    removed: bool = False  # gone from discovery: no new requests, in-flight ones finish
    in_flight: int = 0
    sent_total: int = 0
    # sent_total when the newest successful scrape began: what was sent after it is invisible
    # to that scrape's figures.
    sent_at_scrape: int = 0
    load: LoadReading | None = None
    load_at: float = field(default=float("-inf"))
    scrape_failing: bool = False
    # Requests waiting on this backend with nothing sent to their client yet: told when the
    # probes mark it down (``Lease.on_down``).
    down_watchers: set[Callable[[], None]] = field(default_factory=set)

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def up(self) -> bool:
        return self.health.state is Health.UP

    @property
    def rest(self) -> Rest:
        return rest_of(self.sleep_wanted, self.asleep)
