"""One request's state as its attempts carry it, and what one attempt reports back.

``Call`` is the request as every attempt sends it; ``Try`` is one attempt: its lease, its step,
the policy's ``Decision`` that chose its backend, whether another backend may still be tried,
its span, and the ``Tally`` it fills in (the policy's ``Outcome`` is made from it);
``Expected`` is what the latency tracker expected of it. ``StreamBroken`` is how an attempt
whose stream broke after the client got bytes says so. The loop that makes the attempts is
``gateway.request.attempt``; what one attempt does is
``gateway.request.answer`` (the client's answer), ``gateway.request.resume`` (the rest of a
broken stream) or ``gateway.request.disagg`` (a prefill), each sending through
``gateway.request.send``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from multidict import CIMultiDict
from opentelemetry.trace import Span

from backends.errors import (
    BackendDown,
    BackendRefused,
    FirstTokenLate,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from backends.pool import Lease
from backends.upstream.client import Interrupt, RequestBody
from gateway.http import Request, StreamResponse
from gateway.request.api import Continuing
from gateway.request.continuation import StreamProgress
from gateway.request.endpoints import CHAT, Endpoint
from gateway.request.hedge import Race
from gateway.request.record import Ending, RequestRecord
from gateway.request.rollout import Choice
from gateway.request.router import Step
from gateway.request.services import Services
from policies import Decision, LatencyTracker, Outcome
from policies.latency import Load, Pending, Prediction, prompt_size
from policies.predicted_latency import rescue_declined

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Call:
    """What every attempt of one request sends."""

    request: Request
    svc: Services
    path: str
    body: (
        RequestBody  # bytes, or a spooled upload (``gateway.request.form``) sent again per attempt
    )
    headers: CIMultiDict[str]
    record: RequestRecord
    strip_usage: bool = False
    extra_headers: dict[str, str] | None = None  # added to the client's response
    choice: Choice | None = None  # the model pool chosen for an alias
    # How its stream goes on on another backend if its own fails mid-way (its API's
    # ``continuing``); None when it may not.
    continuing: Continuing[Any] | None = None
    endpoint: Endpoint = CHAT
    # A Responses API request's id, when its response is stored: remembered with the backend
    # that answers it (``gateway.request.responses``)
    response_id: str | None = None
    # Its answer streams tokens: the first one is awaited apart (a policy may set a deadline)
    streamed: bool = False
    # vLLM's priority for the engines that schedule by it (``gateway.request.priority``)
    engine_priority: int | None = None


@dataclass(frozen=True, slots=True)
class Answered:
    """The client's answer, and how it ended as its relay saw it (the request's ending:
    ``gateway.request.record.finish``)."""

    response: StreamResponse
    ending: Ending


@dataclass(slots=True)
class Tally:
    """What one attempt saw, filled in as it goes; ``outcome()`` tells the policy."""

    sent_at: float = field(default_factory=time.monotonic)
    status: int = 0
    first_token_at: float | None = None
    tokens: int | None = None
    error: str | None = None  # Outcome.error's names
    answered: bool = False  # the whole answer arrived (or the stream ended cleanly)

    def failed(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = error_kind(exc)

    def outcome(self) -> Outcome:
        error = self.error
        if error is None:
            if not self.answered:
                error = "abandoned"  # the client left (or the gateway stopped) first
            elif not 200 <= self.status < 300:
                error = "status"
        first = None if self.first_token_at is None else self.first_token_at - self.sent_at
        if error == "late":  # taken back unanswered: its TTFT is at least what it waited
            first = time.monotonic() - self.sent_at
        return Outcome(
            ok=error is None,
            status=self.status,
            error=error,
            first_token_s=first,
            tokens=self.tokens,
            duration_s=time.monotonic() - self.sent_at,
        )

    def judge(self, lease: Lease, outcome: Outcome) -> None:
        """Tell the backend's circuit breaker: an answer (a 4xx too) is a success; a failure
        of the backend is a failure; "busy" (429) and a client that left are neither."""
        if outcome.ok or (outcome.error == "status" and outcome.status < 500):
            lease.succeeded()
        elif outcome.error in ("abandoned", "late") or (
            outcome.error == "refused" and outcome.status == 429
        ):
            return
        else:
            lease.failed()


def error_kind(exc: BaseException) -> str:
    """``Outcome.error``'s name for what an attempt raised."""
    if isinstance(exc, BackendDown):
        return "down"
    if isinstance(exc, FirstTokenLate):
        return "late"  # slow, not broken: sent elsewhere
    if isinstance(exc, UpstreamTimeout):
        return "timeout"
    if isinstance(exc, BackendRefused):
        return "refused"
    if isinstance(exc, UpstreamProtocolError):
        return "protocol"
    if isinstance(exc, UpstreamError):
        return "unreachable"
    if isinstance(exc, StreamBroken):
        return "stream"
    return "abandoned"


@dataclass(slots=True)
class Try:
    """One attempt: on ``lease``'s backend, for ``step``; ``n`` counts the step's attempts."""

    call: Call
    step: Step
    lease: Lease
    decision: Decision  # the step policy's, that chose ``lease``'s backend; settled with it
    n: int
    may_retry: bool  # another backend is left and the retry policy allows one more try
    parent: Span | None
    tally: Tally = field(default_factory=Tally)
    span: Span | None = None
    stream_error: UpstreamError | None = None  # what cut a stream after it began
    expected: Expected | None = None  # what the latency tracker expects of it
    first_token_within: float | None = None  # else sent elsewhere (the policy's rescue)
    interrupt: Interrupt | None = None  # ends its wait early (backend down, first token late)
    race: Race | None = None  # racing another attempt for the client (the policy's hedge)

    def outrun(self) -> bool:
        """Its race's rival took the client."""
        race = self.race
        return race is not None and race.winner is not None and race.winner is not self.interrupt

    def rivalled(self) -> bool:
        """Another attempt of its race still waits for its first bytes (this one may give up
        on a "not now" answer and leave the client to it)."""
        return (
            self.race is not None
            and self.interrupt is not None
            and self.race.rivalled(self.interrupt)
        )


# An attempt: returns what its step produces, or raises ``UpstreamError`` if it failed before
# anything reached the client (the loop may then try another backend).
Attempt = Callable[[Try], Awaitable[T]]


@dataclass(frozen=True, slots=True)
class Expected:
    """What an attempt's outcome is learned and judged against: the load its backend was
    picked under (its cached tokens as the policy's decision says), the latency the tracker
    predicted then, and its prompt's place ahead of newcomers until its first token."""

    load: Load
    predicted: Prediction
    pending: Pending


def expected(tracker: LatencyTracker, step: Step, decision: Decision) -> Expected:
    chosen = decision.backend
    load = tracker.load(chosen, prompt_size(step.facts), decision.cached_tokens)
    predicted = tracker.predict(chosen.id, load)
    if tracker.solve_ahead and tracker.want_refresh():
        # Solved when this task next waits (for the backend, once the request is sent), not
        # on a request's way to its backend; this one was predicted from the last solution.
        asyncio.get_running_loop().call_soon(tracker.refresh)
    return Expected(load, predicted, tracker.begin(chosen.id, load.uncached))


def first_token_deadline(step: Step, backend: str, exp: Expected | None) -> float | None:
    """Seconds the step's policy lets a streamed attempt on ``backend`` wait for its first
    token before it is sent elsewhere (``predicted_latency``'s rescue), from what was
    predicted of it."""
    rescue = step.caps.first_token_deadline
    if rescue is None or exp is None:
        return None
    return rescue.first_token_deadline(backend, exp.predicted.ttft)


# The event loop ran the deadline this much late or more: the gateway itself is saturated, and
# what delayed the first token may be its own queue, which another backend would not shorten.
RESCUE_MAX_LAG_S: Final = 0.02


def rescue_now(t: Try, lag: float) -> bool:
    """At its deadline, whether to take ``t`` back: only if the gateway is keeping up and
    another backend could take the request without queueing (``rescue_declined``); else it
    waits on (a late answer beats none, and a place in one queue the end of another)."""
    svc = t.call.svc
    why = "gateway_lag" if lag >= RESCUE_MAX_LAG_S else None
    why = why or rescue_declined(svc.router.others(t.step, t.lease.backend.id))
    if why is not None:
        svc.metrics.rescues_declined.labels(why).inc()
        return False
    return True


class StreamBroken(Exception):
    """A stream broke after bytes reached the client, and may be continued elsewhere.

    Carries the client's response, still open, and what the client has received; raised
    out of the attempt so that its lease is released and its backend judged as for any
    failure, then caught where the stream is continued (``gateway.request.resume``).
    """

    def __init__(
        self,
        response: StreamResponse,
        error: UpstreamError,
        backend: str,
        progress: StreamProgress,  # its call's ``continuing.progress()``
    ) -> None:
        super().__init__(error.message)
        self.response = response
        self.error = error
        self.backend = backend
        self.progress = progress
