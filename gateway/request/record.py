"""What happened to one request, and where that goes when it ends: one log event, metrics."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

import structlog

from backends.errors import GatewayError
from gateway.limits.tokens import Usage
from policies import BackendSnapshot, Weights, score

if TYPE_CHECKING:
    from gateway.observe.metrics import GatewayMetrics
    from gateway.request.router import Router

log = structlog.get_logger("gateway.request")

OTHER: Final = "other"  # the label of every name the fleet does not serve
_LOGGED_NAME_CHARS: Final = 200  # a client's model name is cut to this in the log event


class Ending(enum.Enum):
    """How an answer that reached the client ended (what the relay saw)."""

    COMPLETE = "complete"
    UPSTREAM_ERROR = "upstream_error"
    CLIENT_DISCONNECT = "client_disconnect"


# What ended a request: its answer's ending, or the exception that ended it (``finish``).
RequestOutcome = Ending | BaseException


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request: for its log event, its metrics and its span."""

    request_id: str
    started: float
    model: str = "unknown"
    endpoint: str = "chat"  # ``gateway.request.endpoints``' name of what was asked
    pool: str | None = None  # the model pool chosen for an alias (gateway.request.rollout)
    key: str | None = None  # the API key's name (never the key)
    sent: bool = False  # an attempt reached a backend
    usage: Usage | None = None
    backends: list[str] = field(default_factory=list)
    candidates: list[BackendSnapshot] = field(default_factory=list)
    status: int = 0
    # How it ended: complete, upstream_error, client_disconnect, shutdown, internal_error, or
    # the name of the GatewayError that refused it. Said once, by ``finish``.
    ending: str | None = None
    first_token_at: float | None = None
    ended_at: float | None = None
    events: int = 0
    abort_reason: str | None = None
    continuations: int = 0  # times the stream went on from another backend
    hedged: bool = False  # a copy raced on a second backend (``gateway.request.hedge``)
    priority: int = 0  # the gateway's (higher goes first): its tier's, or the header's
    held: bool = False  # held while an engine of its model woke (``gateway.capacity.hold``)
    # the extra attempt the retry budget refused it (``gateway.limits.retry_budget``), if any
    budget_refused: str | None = None

    @property
    def backend(self) -> str:
        return self.backends[-1] if self.backends else "none"

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def duration(self) -> float:
        return (self.ended_at or time.monotonic()) - self.started

    def mean_itl(self) -> float | None:
        """Mean gap between output tokens after the first (None if too few to tell).

        Tokens from the usage the backend reported; without it, from the events relayed
        (less the first token's and the closing [DONE]).
        """
        if self.first_token_at is None or self.ended_at is None:
            return None
        after_first = (
            self.usage.completion_tokens - 1 if self.usage is not None else self.events - 2
        )
        if after_first < 1:
            return None
        return (self.ended_at - self.first_token_at) / after_first

    def log_fields(self, weights: Weights | None) -> dict[str, Any]:
        ttft = self.ttft
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            "model": self.model[:_LOGGED_NAME_CHARS],
            "endpoint": self.endpoint,
            "pool": self.pool,
            "backend": self.backend,
            "attempts": len(self.backends),
            "status": self.status,
            "ending": self.ending,
            "ttft_ms": None if ttft is None else round(ttft * 1e3, 2),
            "duration_ms": round(self.duration * 1e3, 2),
            "events": self.events or None,
            "key": self.key,
            "prompt_tokens": self.usage.prompt_tokens if self.usage else None,
            "completion_tokens": self.usage.completion_tokens if self.usage else None,
        }
        if self.continuations:
            fields["continuations"] = self.continuations
        if self.hedged:
            fields["hedged"] = True
        if self.priority:
            fields["priority"] = self.priority
        if self.held:
            fields["held_for_wake"] = True
        if self.budget_refused is not None:
            fields["retry_budget_refused"] = self.budget_refused
        if len(self.backends) > 1:
            fields["tried"] = self.backends
        if self.candidates:
            fields["candidates"] = {
                c.id: round(score(c, weights), 3) if weights else c.in_flight
                for c in self.candidates
            }
        return fields


class Finishing(Protocol):
    """What ``finish`` reads of the request path's services (``Services`` is one)."""

    @property
    def metrics(self) -> GatewayMetrics: ...

    @property
    def router(self) -> Router: ...

    def cancel_reason(self) -> str: ...


def conclude(
    record: RequestRecord, outcome: RequestOutcome, cancel_reason: Callable[[], str]
) -> str:
    """Say how the request ended, from what ended it: its answer's ending as the relay saw it,
    or what the exception means (a ``GatewayError``'s status and name; a cancellation before
    the answer ended: ``cancel_reason()``, the client left or the gateway stops; anything
    else is a bug the client got a 500 for)."""
    if isinstance(outcome, Ending):
        record.ending = outcome.value
    elif isinstance(outcome, GatewayError):
        record.status, record.ending = outcome.status, type(outcome).__name__
    elif isinstance(outcome, asyncio.CancelledError):
        record.ending = cancel_reason()
    else:
        record.status, record.ending = 500, "internal_error"
    return record.ending


def finish(svc: Finishing, record: RequestRecord, outcome: RequestOutcome) -> None:
    """Record a finished request, ended by ``outcome`` (``conclude``): metrics always, the log
    event when info is enabled.

    The model label is the model's name only if the fleet serves it (or it is an alias):
    any other name a client sends is ``other``, so clients cannot grow the series.
    """
    if record.ended_at is None:
        record.ended_at = time.monotonic()
    ending = conclude(record, outcome, svc.cancel_reason)
    metrics = svc.metrics
    backend = record.backend
    model = record.model if svc.router.pool.serves(record.model) or record.pool else OTHER
    metrics.requests.labels(model, backend, str(record.status), record.endpoint).inc()
    metrics.duration.labels(model, backend).observe(record.duration)
    ttft = record.ttft
    if ttft is not None:
        metrics.ttft.labels(model, backend).observe(ttft)
    itl = record.mean_itl()
    if itl is not None:
        metrics.itl.labels(model, backend).observe(itl)
    if record.pool is not None:
        metrics.record_pool(record.model, record.pool, record.status, ending, ttft=ttft, itl=itl)
    if record.abort_reason is not None:
        metrics.aborts.labels(backend, record.abort_reason).inc()
    if len(record.backends) > 1 and record.status and record.status < 500 and not record.hedged:
        metrics.failovers.labels(model).inc()
    if log.is_enabled_for(logging.INFO):
        weights = svc.router.policy.weights
        log.info("request", **record.log_fields(weights))
