"""The gateway's services: every long-lived object of one gateway process, by name.

Built once, in dependency order, by the composition root (``gateway.root.open_gateway``),
which owns their cleanup, and handed as they are to the data plane (its handlers close over
them; each request carries them down as ``gateway.request.call.Call.svc``) and to the admin API
(``gateway.admin.context``). Each field is one object for the process's whole life: a reload
or an admin change changes what it holds, never which object it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # names for the type checker only: ZMQ, tokenizers and Jinja load on use
    from opentelemetry.trace import Tracer

    from backends.kv.feed import KvFeeds
    from backends.monitor import BackendMonitor
    from backends.pool import BackendPool
    from backends.upstream.client import Transport
    from gateway.capacity.book import CapacityBook
    from gateway.capacity.hold import Holds
    from gateway.capacity.manager import Manager
    from gateway.config.settings import Settings
    from gateway.config.source import ConfigSource
    from gateway.fleet.member import Member
    from gateway.limits.admission import AdmissionQueue
    from gateway.limits.limiter import Limiter
    from gateway.limits.retry_budget import RetryBudget
    from gateway.observe.metrics import GatewayMetrics
    from gateway.request.generate import Generations
    from gateway.request.hedge import HedgeBudget
    from gateway.request.responses import ResponseHomes
    from gateway.request.retry import RetryPolicy
    from gateway.request.rollout import Rollout
    from gateway.request.router import Router
    from gateway.request.slo import ChangeSignal
    from gateway.rollouts.driver import Driver
    from gateway.rollouts.state import RolloutBook
    from gateway.tokenizer import Tokenizers
    from gateway.workers.shared_reads import ReadCache
    from gateway.workers.supervisor import Worker
    from policies.kv_index import KvIndex
    from policies.latency import LatencyTracker


@dataclass(slots=True)
class Lifecycle:
    """Set when the process starts shutting down: /ready turns 503, new requests are refused."""

    stopping: bool = False


@dataclass(frozen=True, slots=True, eq=False)
class Services:
    settings: Settings  # as the process started (a reload's: ``config.current``)
    config: ConfigSource  # where the configuration comes from, what of it is in force
    lifecycle: Lifecycle
    metrics: GatewayMetrics
    tracer: Tracer | None
    # the backends
    pool: BackendPool  # every backend's state: mutated here only
    upstream: Transport  # how backends are reached
    monitor: BackendMonitor  # their health, load and models, read in the background
    kv_index: KvIndex  # what each engine caches (its KV events)
    kv_feeds: KvFeeds | None  # None: KV events not followed
    latency: LatencyTracker  # each backend's learned speed
    tokenizers: Tokenizers | None  # None: none configured
    # routing and attempts
    router: Router
    rollout: Rollout  # model pools and aliases
    retry: RetryPolicy
    retry_budget: RetryBudget  # what retries, hedges and continuations draw on
    hedges: HedgeBudget  # predicted_latency's hedges running now
    changes: ChangeSignal  # wakes requests waiting for their TTFT objective
    # admission
    limiter: Limiter
    admission: AdmissionQueue | None  # None: no admission queue
    holds: Holds | None  # requests held while an engine wakes (None: capacity off)
    # the request path's memory
    response_homes: ResponseHomes  # which backend holds each stored response
    generations: Generations  # /inference/v1/generate in flight, for the abort route
    # what only admin changes move (the fleet's log, or this replica's admin API)
    adapters: dict[str, dict[str, object]]  # LoRA adapters: name -> path, model, backends
    rollouts: RolloutBook  # progressive rollouts (``gateway.rollouts``)
    capacity: CapacityBook  # capacity's rules and its manager's token
    # what runs on the services, started last
    fleet: Member | None  # this replica in its fleet (``gateway.fleet``); None: it acts alone
    driver: Driver  # drives the rollouts whose lease this replica holds
    manager: Manager | None  # the capacity manager (None: capacity off)
    # ``serve --workers``: this process's place among them (None: a process alone)
    worker: Worker | None
    read_cache: ReadCache | None  # worker 0's latest backend readings (None: not a worker)

    def cancel_reason(self) -> str:
        """Why a handler was cancelled: its client left, or the gateway is shutting down."""
        return "shutdown" if self.lifecycle.stopping else "client_disconnect"
