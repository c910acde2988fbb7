"""What one request carries into each attempt on a backend, and what an attempt reports back.

``Call`` is the request as every attempt sends it; ``Try`` is one attempt: its lease, its
step, whether another backend may still be tried, its span, and the ``Tally`` it fills in (the
policy's ``Outcome`` is made from it). ``open_upstream`` is how every kind of attempt (a whole
answer, a prefill step) sends its request: with the trace context, an ``Interrupt`` that ends
the wait if the backend is marked down, and the upstream abort counted if the client leaves
while the backend has not answered yet. ``attempts`` is the loop every step runs: pick a
backend, attempt, judge, release, back off, pick again among those not yet tried.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import structlog
from aiohttp import web
from multidict import CIMultiDict
from opentelemetry.trace import Span, set_span_in_context

from backends.errors import (
    BackendDown,
    BackendRefused,
    FirstTokenLate,
    NoBackendAvailable,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from backends.pool import Lease
from backends.upstream.client import Interrupt, RequestBody, Upstream
from gateway.http import Request
from gateway.keys import HEDGES, LATENCY, LIFECYCLE, METRICS, RETRY, ROUTER, TRACER, UPSTREAM
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.tracing import attempt_span, end_attempt, inject
from gateway.request.endpoints import CHAT, Endpoint
from gateway.request.hedge import Race
from gateway.request.record import RequestRecord
from gateway.request.relay import StreamBroken
from gateway.request.retry import RetryPolicy
from gateway.request.rollout import Choice
from gateway.request.router import Step
from policies import BackendSnapshot, LatencyTracker, Outcome
from policies.latency import Load, Pending, Prediction, prompt_size
from policies.predicted_latency import rescue_declined

T = TypeVar("T")
log = structlog.get_logger("gateway.request")
_rng = random.Random()


@dataclass(frozen=True, slots=True)
class Call:
    """What every attempt of one request sends."""

    request: Request
    path: str
    body: (
        RequestBody  # bytes, or a spooled upload (``gateway.request.form``) sent again per attempt
    )
    headers: CIMultiDict[str]
    record: RequestRecord
    strip_usage: bool = False
    extra_headers: dict[str, str] | None = None  # added to the client's response
    choice: Choice | None = None  # the model pool chosen for an alias
    # The request as parsed, when its stream may be continued on another backend if its own
    # fails mid-way (``gateway.request.continuation``); None when it may not.
    resumable: dict[str, Any] | None = None
    endpoint: Endpoint = CHAT
    # A Responses API request's id, when its response is stored: remembered with the backend
    # that answers it (``gateway.request.responses``)
    response_id: str | None = None
    # Its answer streams tokens: the first one is awaited apart (a policy may set a deadline)
    streamed: bool = False

    @property
    def chat(self) -> bool:
        return self.endpoint is CHAT


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
    picked under (its cached tokens as the policy believed, if it says), the latency the
    tracker predicted then, and its prompt's place ahead of newcomers until its first token."""

    load: Load
    predicted: Prediction
    pending: Pending


def expected(tracker: LatencyTracker, step: Step, chosen: BackendSnapshot) -> Expected:
    facts = step.facts
    held = step.caps.cached_tokens
    cached = held.cached_tokens(facts, chosen.id) if held is not None else 0.0
    load = tracker.load(chosen, prompt_size(facts), cached)
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


def _rescue_now(t: Try, lag: float) -> bool:
    """At its deadline, whether to take ``t`` back: only if the gateway is keeping up and
    another backend could take the request without queueing (``rescue_declined``); else it
    waits on (a late answer beats none, and a place in one queue the end of another)."""
    app = t.call.request.app
    why = "gateway_lag" if lag >= RESCUE_MAX_LAG_S else None
    why = why or rescue_declined(app[ROUTER].others(t.step, t.lease.backend.id))
    if why is not None:
        app[METRICS].rescues_declined.labels(why).inc()
        return False
    return True


def cancel_reason(app: web.Application) -> str:
    """Why a handler was cancelled: its client left, or the gateway is shutting down."""
    return "shutdown" if app[LIFECYCLE].stopping else "client_disconnect"


async def open_upstream(t: Try, body: RequestBody) -> Upstream:
    """Send ``body`` on ``t``'s backend and return once its answer's head is in.

    Until something reaches the client, and if another backend could take the request, the
    lease's down signal interrupts the wait (``BackendDown``): a backend marked down may still
    answer, so with nowhere else to go the request keeps waiting. A cancellation here (the
    client left) counts as an upstream abort: closing the half-open request is what tells the
    backend to stop.
    """
    call = t.call
    app, record = call.request.app, call.record
    headers = call.headers
    if t.parent is not None:
        t.span = attempt_span(app[TRACER], t.parent, t.lease.backend.id, t.n)
        t.span.set_attribute("llm_gateway.step", t.step.name)
        headers = CIMultiDict(headers)
        inject(headers, set_span_in_context(t.span))
    interrupt = None
    if t.may_retry or t.race is not None:  # another backend could take the request instead
        interrupt = Interrupt() if t.race is None else t.race.join()
        if t.may_retry:
            t.lease.on_down(interrupt.fire)
        if t.first_token_within is not None:
            interrupt.deadline(t.first_token_within, lambda lag: _rescue_now(t, lag))
        t.interrupt = interrupt
    t.tally.sent_at = time.monotonic()
    try:
        upstream = await app[UPSTREAM].open(
            t.lease.backend.spec, call.path, body, headers, interrupt=interrupt
        )
    except asyncio.CancelledError:
        record.abort_reason = cancel_reason(app)
        raise
    record.sent = True
    t.tally.status = upstream.status
    return upstream


def _settle(t: Try, error: BaseException | None, tracker: LatencyTracker) -> None:
    """An attempt is over: its outcome judged (the circuit), the lease released, the policy
    and the latency tracker told, its span ended."""
    if t.interrupt is not None:
        t.interrupt.disarm()  # its deadline, if any, is moot now
    if error is not None:
        t.tally.failed(error)
    outcome = t.tally.outcome()
    lease, backend = t.lease, t.lease.backend.id
    t.tally.judge(lease, outcome)
    lease.release()
    t.step.policy.on_result(t.step.facts, backend, outcome)
    if t.expected is not None:
        t.expected.pending.done()
        tracker.observe(backend, t.expected.load, outcome, t.expected.predicted)
    cancelled = isinstance(error, asyncio.CancelledError)
    end_attempt(t.span, t.tally.status, None if cancelled else error or t.stream_error)


async def attempts(
    call: Call,
    step: Step,
    parent: Span | None,
    attempt: Attempt[T],
    *,
    retry: RetryPolicy | None = None,
    since: float | None = None,
    exclude: Sequence[str] = (),
) -> T:
    """Pick, attempt, classify, back off, pick again: the one loop every step runs.

    The lease is released, and the policy told the outcome, before any backoff. When no
    backend is left (or the retry policy says stop), the last failure is the answer: a
    backend's own "not now" as it gave it, or the gateway's error. ``retry`` and ``since``
    (default: the gateway's retry policy, from the request's arrival) bound the attempts;
    ``exclude``: backends not to try.
    """
    app, record = call.request.app, call.record
    router, metrics, tracker = app[ROUTER], app[METRICS], app[LATENCY]
    retry = retry or app[RETRY]
    since = record.started if since is None else since
    tried: list[str] = list(exclude)
    last: UpstreamError | None = None
    while True:
        try:
            lease, candidates, chosen = router.pick(step, exclude=tried)
        except NoBackendAvailable:
            if last is not None:  # every candidate failed: say how the last did
                raise last from None
            raise
        backend = lease.backend.id
        tried.append(backend)
        if step.name != "prefill":
            record.backends.append(backend)
            record.candidates = record.candidates or candidates
        n = len(tried) - len(exclude)
        elapsed = time.monotonic() - since
        may_retry = len(candidates) > 1 and retry.allows(n, elapsed)
        t = Try(call, step, lease, n, may_retry, parent, expected=expected(tracker, step, chosen))
        hedge_after = _rescue_plan(t) if n == 1 else None
        try:
            if hedge_after is not None:
                return await _hedged(t, attempt, hedge_after, tried)
            return await _settled(t, attempt, tracker)
        except UpstreamError as exc:  # nothing reached the client
            last = exc
        reason = type(last).__name__
        if step.role is not None:
            metrics.disagg_failures.labels(step.name, backend, reason).inc()
        wait = retry.next_wait(n, time.monotonic() - since, _rng)
        if not may_retry or wait is None:
            raise last
        if isinstance(last, FirstTokenLate):
            wait = 0.0  # the backend is slow, not failing: nothing to back off from
        metrics.retries.labels(backend, reason).inc()
        log.info(
            "upstream_retry",
            step=step.name,
            backend=backend,
            error=last.message,
            wait_ms=round(wait * 1e3, 1),
        )
        await asyncio.sleep(wait)


def _rescue_plan(t: Try) -> float | None:
    """A first attempt's rescue, if its policy sets one: its first-token deadline is set for a
    move (``t.first_token_within``), or returned for a hedge (None: no hedge)."""
    call, step = t.call, t.step
    if not (t.may_retry and call.streamed and step.role != "prefill"):
        return None
    within = first_token_deadline(step, t.lease.backend.id, t.expected)
    hedging = step.caps.hedging
    if within is None or hedging is None or not hedging.hedges:
        t.first_token_within = within
        return None
    # A stored response has one home; a decode step's KV cache is pulled once, by one engine.
    if call.response_id is not None or step.role is not None:
        t.first_token_within = within  # moved instead
        return None
    return within


async def _settled(t: Try, attempt: Attempt[T], tracker: LatencyTracker) -> T:
    """Run one attempt; whatever its ending, settle it (``_settle``)."""
    error: BaseException | None = None
    try:
        return await attempt(t)
    except BaseException as exc:
        error = exc
        raise
    finally:
        _settle(t, error, tracker)


async def _hedged(t: Try, attempt: Attempt[T], after: float, tried: list[str]) -> T:
    """Run ``t``; if it has no first bytes ``after`` seconds on, race a copy of it on another
    backend (``gateway.request.hedge``): the first to have its first bytes answers the client, the
    other is ended unsent. Declined as the rescue is (``_rescue_now``), and when no other
    backend can be picked. Raises what the first attempt raised, or, if both failed before
    anything reached the client, the first's ``UpstreamError`` (the loop may try another)."""
    call, step = t.call, t.step
    app, record = call.request.app, call.record
    router, metrics, tracker = app[ROUTER], app[METRICS], app[LATENCY]
    loop = asyncio.get_running_loop()
    race = t.race = Race()
    first = asyncio.ensure_future(_settled(t, attempt, tracker))
    tasks: list[asyncio.Future[T]] = [first]
    try:
        due = loop.time() + after
        await asyncio.wait(tasks, timeout=after)
        if first.done() or race.winner is not None or not _rescue_now(t, loop.time() - due):
            return await first
        budget, pool = app[HEDGES], router.pool
        hedging = step.caps.hedging
        share = hedging.hedge_budget if hedging is not None else 0.0
        give_back = budget.take(share, sum(pool.in_flight(b) for b in pool.all()))
        if give_back is None:
            metrics.rescues_declined.labels("hedge_budget").inc()
            return await first
        try:
            lease, _, chosen = router.pick(step, exclude=tried)
        except NoBackendAvailable:
            give_back()
            metrics.rescues_declined.labels("no_other_backend").inc()
            return await first
        backend = lease.backend.id
        tried.append(backend)
        record.backends.append(backend)
        record.hedged = True
        hedge = Try(
            call, step, lease, t.n + 1, False, t.parent, expected=expected(tracker, step, chosen)
        )
        hedge.race = race
        race.decided = give_back  # or the copy ends first
        tasks.append(asyncio.ensure_future(_settled(hedge, attempt, tracker)))
        tasks[-1].add_done_callback(lambda _: give_back())
        log.info("upstream_hedge", backend=t.lease.backend.id, hedge=backend)
        await asyncio.wait(tasks)  # the winner's whole answer; the other ends at once
    except asyncio.CancelledError:  # the client left (or the gateway stops): end both
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        raise
    return _outcome(t, tasks, record, metrics)


def _outcome(
    t: Try, tasks: list[asyncio.Future[T]], record: RequestRecord, metrics: GatewayMetrics
) -> T:
    """What a race that ran to its end gives: the answer of the attempt that took the client,
    else what stopped them (a failure after the client got bytes first, then the first's)."""
    race = t.race
    assert race is not None
    won = "neither"
    if race.winner is not None:
        won = "first" if race.winner is t.interrupt else "hedge"
    metrics.hedges.labels(won).inc()
    if won == "first" and t.lease.backend.id in record.backends:  # named last: it answered
        record.backends.remove(t.lease.backend.id)
        record.backends.append(t.lease.backend.id)
    errors = [task.exception() for task in tasks]
    for task, error in zip(tasks, errors, strict=True):
        if error is None:
            return task.result()
    for error in errors:
        if not isinstance(error, UpstreamError):
            raise error  # type: ignore[misc]
    raise errors[0]  # type: ignore[misc]
