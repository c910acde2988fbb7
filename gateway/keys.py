"""Typed keys for what the app and each request carry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from aiohttp import web
from opentelemetry.trace import Tracer

from backends.monitor import BackendMonitor
from backends.pool import BackendPool
from backends.supervise import Supervisor
from backends.upstream.client import Transport
from gateway.capacity.book import CapacityBook
from gateway.capacity.hold import Holds
from gateway.capacity.manager import Manager
from gateway.config.settings import Settings
from gateway.http import Routes
from gateway.limits.admission import AdmissionQueue
from gateway.limits.limiter import Limiter
from gateway.limits.retry_budget import Budget
from gateway.observe.metrics import GatewayMetrics
from gateway.request.generate import Generations
from gateway.request.hedge import HedgeBudget
from gateway.request.responses import ResponseHomes
from gateway.request.retry import RetryPolicy
from gateway.request.router import Router
from gateway.rollouts.driver import Claim, Driver
from gateway.rollouts.state import RolloutBook
from gateway.workers.shared_reads import ReadCache
from gateway.workers.supervisor import Worker
from policies.kv_index import KvIndex
from policies.latency import LatencyTracker

if TYPE_CHECKING:  # loaded only when used: ZMQ, tokenizers and Jinja cost memory and start-up
    from backends.kv.feed import KvFeeds  # noqa: F401 - named in KV_FEEDS below
    from gateway.fleet.member import Member  # noqa: F401 - named in FLEET below
    from gateway.tokenizer import Tokenizers  # noqa: F401 - named in TOKENIZERS below


@dataclass(slots=True)
class Lifecycle:
    """Set when the process starts shutting down: /ready turns 503, new requests are refused."""

    stopping: bool = False


SETTINGS: Final = web.AppKey("settings", Settings)
POOL: Final = web.AppKey("pool", BackendPool)
ROUTER: Final = web.AppKey("router", Router)
RETRY: Final = web.AppKey("retry", RetryPolicy)
UPSTREAM: Final = web.AppKey[Transport]("upstream")
MONITOR: Final = web.AppKey("monitor", BackendMonitor)
SUPERVISOR: Final = web.AppKey("supervisor", Supervisor)
LIFECYCLE: Final = web.AppKey("lifecycle", Lifecycle)
ROUTES: Final = web.AppKey("routes", Routes)  # the data plane's
HEDGES: Final = web.AppKey("hedges", HedgeBudget)  # predicted_latency's hedges running now
METRICS: Final = web.AppKey("metrics", GatewayMetrics)
LIMITER: Final = web.AppKey("limiter", Limiter)
# the one budget of extra attempts: this replica's, or the fleet's on Redis
RETRY_BUDGET: Final = web.AppKey[Budget]("retry_budget")
ADMISSION: Final = web.AppKey[AdmissionQueue | None]("admission")
TRACER: Final = web.AppKey[Tracer | None]("tracer")
GATEWAY: Final = web.AppKey("gateway", web.Application)
KV_INDEX: Final = web.AppKey("kv_index", KvIndex)  # what each engine caches (its KV events)
WORKER: Final = web.AppKey("worker", Worker)  # one of ``serve --workers``' processes
READ_CACHE: Final = web.AppKey("read_cache", ReadCache)  # worker 0's latest backend readings
LATENCY: Final = web.AppKey("latency", LatencyTracker)  # each backend's learned speed
KV_FEEDS: Final = web.AppKey["KvFeeds | None"]("kv_feeds")  # None: events not followed
TOKENIZERS: Final = web.AppKey["Tokenizers | None"]("tokenizers")  # None: none configured
# the Responses API: which backend holds each stored response (``gateway.request.responses``)
RESPONSE_HOMES: Final = web.AppKey[ResponseHomes]("response_homes")
GENERATIONS: Final = web.AppKey[Generations]("generations")  # /inference/v1/generate in flight

# this replica's membership of its fleet (``gateway.fleet.member``); None: it acts alone
FLEET: Final = web.AppKey["Member | None"]("fleet")
# LoRA adapters loaded at run time: name -> its path, base model and backends (the fleet's log)
ADAPTERS: Final = web.AppKey[dict[str, dict[str, object]]]("adapters")
ROLLOUTS: Final = web.AppKey("rollouts", RolloutBook)  # progressive rollouts (gateway.rollouts)
# A rollout's lease by alias (the fleet's, on Redis; or standing for one), and its driver
CLAIMS: Final = web.AppKey[Callable[[str], Claim]]("claims")
DRIVER: Final = web.AppKey("driver", Driver)
# Capacity (gateway.capacity): its rules and token (the fleet's log), the requests held for a
# wake (None: capacity off), and the manager (None: off)
CAPACITY: Final = web.AppKey("capacity", CapacityBook)
CAPACITY_CLAIM: Final = web.AppKey[Claim]("capacity_claim")  # the manager's lease
HOLDS: Final = web.AppKey[Holds | None]("holds")
MANAGER: Final = web.AppKey[Manager | None]("manager")

REQUEST_ID_KEY: Final = web.RequestKey("request_id", str)
