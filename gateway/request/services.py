"""What the request path uses, handed in once: the app's services, read when it has started.

The model endpoints' handlers take one ``Services`` per request (``SERVICES``, set by
``gateway.app`` once every cleanup context has run) and hand it down with the request
(``gateway.request.call.Call.svc``), so that no step looks a service up in the app by key.
Each field is the one object the app holds under its key for its whole life (a reload changes
what they hold, not which objects they are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from aiohttp import web
from opentelemetry.trace import Tracer

from backends.upstream.client import Transport
from gateway.capacity.hold import Holds
from gateway.config.settings import Settings
from gateway.keys import (
    ADMISSION,
    GENERATIONS,
    HEDGES,
    HOLDS,
    LATENCY,
    LIFECYCLE,
    LIMITER,
    METRICS,
    RESPONSE_HOMES,
    RETRY,
    RETRY_BUDGET,
    ROUTER,
    SETTINGS,
    TOKENIZERS,
    TRACER,
    UPSTREAM,
    Lifecycle,
)
from gateway.limits.admission import AdmissionQueue
from gateway.limits.limiter import Limiter
from gateway.limits.retry_budget import Budget
from gateway.observe.metrics import GatewayMetrics
from gateway.request.generate import Generations
from gateway.request.hedge import HedgeBudget
from gateway.request.responses import ResponseHomes
from gateway.request.retry import RetryPolicy
from gateway.request.rollout import ROLLOUT, Rollout
from gateway.request.router import Router
from gateway.request.slo import CHANGES, ChangeSignal
from policies.latency import LatencyTracker

if TYPE_CHECKING:
    from gateway.tokenizer import Tokenizers


@dataclass(frozen=True, slots=True)
class Services:
    settings: Settings
    router: Router
    rollout: Rollout
    limiter: Limiter
    admission: AdmissionQueue | None
    upstream: Transport
    metrics: GatewayMetrics
    tracer: Tracer | None
    latency: LatencyTracker
    retry: RetryPolicy
    hedges: HedgeBudget
    lifecycle: Lifecycle
    response_homes: ResponseHomes
    tokenizers: Tokenizers | None
    generations: Generations
    changes: ChangeSignal
    holds: Holds | None  # requests held while an engine wakes (None: capacity off)
    retry_budget: Budget  # what retries, hedges and continuations draw on

    @classmethod
    def of(cls, app: web.Application) -> Services:
        return cls(
            settings=app[SETTINGS],
            router=app[ROUTER],
            rollout=app[ROLLOUT],
            limiter=app[LIMITER],
            admission=app[ADMISSION],
            upstream=app[UPSTREAM],
            metrics=app[METRICS],
            tracer=app[TRACER],
            latency=app[LATENCY],
            retry=app[RETRY],
            hedges=app[HEDGES],
            lifecycle=app[LIFECYCLE],
            response_homes=app[RESPONSE_HOMES],
            tokenizers=app[TOKENIZERS],
            generations=app[GENERATIONS],
            changes=app[CHANGES],
            holds=app[HOLDS],
            retry_budget=app[RETRY_BUDGET],
        )

    def cancel_reason(self) -> str:
        """Why a handler was cancelled: its client left, or the gateway is shutting down."""
        return "shutdown" if self.lifecycle.stopping else "client_disconnect"


SERVICES: Final = web.AppKey("services", Services)


async def hand_in(app: web.Application) -> None:
    """``on_startup``, after every cleanup context: the services as the request path gets them."""
    app[SERVICES] = Services.of(app)
