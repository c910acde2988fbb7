"""The attempt loop every step of a request runs: pick a backend, attempt, judge, release,
back off, pick again among those not yet tried; and the hedge, a second attempt racing the
first for the client (``gateway.request.hedge``).

What one attempt does is handed in (``Attempt``: ``gateway.request.answer.answer`` for the
client's answer); the loop returns what the attempt returned, or raises what ended the last one.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import TypeVar

import structlog
from opentelemetry.trace import Span

from backends.errors import FirstTokenLate, NoBackendAvailable, UpstreamError
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.tracing import end_attempt
from gateway.request.call import (
    Attempt,
    Call,
    Try,
    expected,
    first_token_deadline,
    rescue_now,
)
from gateway.request.hedge import Race
from gateway.request.record import RequestRecord
from gateway.request.retry import RetryPolicy
from gateway.request.router import Step
from policies import LatencyTracker

T = TypeVar("T")
log = structlog.get_logger("gateway.request")
_rng = random.Random()


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
    t.step.policy.on_result(t.step.facts, t.decision, outcome)
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
    svc, record = call.svc, call.record
    router, metrics, tracker = svc.router, svc.metrics, svc.latency
    retry = retry or svc.retry
    since = record.started if since is None else since
    tried: list[str] = list(exclude)
    last: UpstreamError | None = None
    while True:
        try:
            lease, candidates, decision = router.pick(step, exclude=tried)
        except NoBackendAvailable:
            if last is not None:  # every candidate failed: say how the last did
                raise last from None
            if await _held(call, step):  # its engines sleep: one is awake now
                continue
            raise
        backend = lease.backend.id
        tried.append(backend)
        if step.name != "prefill":
            record.backends.append(backend)
            record.candidates = record.candidates or candidates
        n = len(tried) - len(exclude)
        elapsed = time.monotonic() - since
        may_retry = len(candidates) > 1 and retry.allows(n, elapsed)
        exp = expected(tracker, step, decision)
        t = Try(call, step, lease, decision, n, may_retry, parent, expected=exp)
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
        if not await svc.retry_budget.take("retry"):  # failed as it would have without it
            record.budget_refused = "retry"
            log.warning("upstream_retry_refused", backend=backend, why="retry_budget")
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


async def _held(call: Call, step: Step) -> bool:
    """Hold a request whose model's engines all sleep while one wakes (``gateway.capacity.hold``):
    True once one is awake, False if there is nothing to wait for (the pick's refusal stands)."""
    holds = call.svc.holds
    if holds is None or step.role is not None:
        return False
    call.record.held = True
    return await holds.hold(step.facts.model, step.only)


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
    svc, record = call.svc, call.record
    router, metrics, tracker = svc.router, svc.metrics, svc.latency
    loop = asyncio.get_running_loop()
    race = t.race = Race()
    first = asyncio.ensure_future(_settled(t, attempt, tracker))
    tasks: list[asyncio.Future[T]] = [first]
    try:
        due = loop.time() + after
        await asyncio.wait(tasks, timeout=after)
        if first.done() or race.winner is not None or not rescue_now(t, loop.time() - due):
            return await first
        budget, pool = svc.hedges, router.pool
        hedging = step.caps.hedging
        share = hedging.hedge_budget if hedging is not None else 0.0
        give_back = budget.take(share, sum(pool.in_flight(b) for b in pool.all()))
        if give_back is None:
            metrics.rescues_declined.labels("hedge_budget").inc()
            return await first
        if not await svc.retry_budget.take("hedge"):  # extra attempts are over their budget
            give_back()
            metrics.rescues_declined.labels("retry_budget").inc()
            record.budget_refused = "hedge"
            return await first
        try:
            lease, _, decision = router.pick(step, exclude=tried)
        except NoBackendAvailable:
            give_back()
            metrics.rescues_declined.labels("no_other_backend").inc()
            return await first
        backend = lease.backend.id
        tried.append(backend)
        record.backends.append(backend)
        record.hedged = True
        exp = expected(tracker, step, decision)
        hedge = Try(call, step, lease, decision, t.n + 1, False, t.parent, expected=exp)
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
