"""The request path, top to bottom: parse, admit, route, attempt, relay, release.

``forward`` reads the body once (``gateway.body``), authenticates and admits the request (rate
limits, then the admission queue while the fleet is saturated), and decides its route once
(``Router.route``): one step for a model served whole, by any of its backends or by the model
pool an alias chose; two for a model served by prefill and decode pools, the prefill's KV
handed to the decode (``gateway.disagg``). Every step runs the same attempt loop,
``_attempts``: pick a backend, attempt, classify, release the lease, back off, pick again among
the backends not yet tried, for as long as the retry policy allows. Only an attempt that has
sent nothing to the client is retried; a backend that answers "not now" (429, 503...) is passed
over while another is left, and its answer is the client's when none is. The policy hears how
each attempt ended (``Policy.on_result``).

Every attempt holds one lease on a backend, released in one ``finally`` on every way out:
success, error, timeout and client disconnect (aiohttp cancels the handler when the client goes
away, because the server runs with ``handler_cancellation``). Closing the upstream response
early closes its connection, which is how vLLM learns to abort.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Final

import structlog
from aiohttp import web
from opentelemetry.trace import Span, SpanKind

from backends.errors import (
    BackendRefused,
    BackendStalled,
    EngineFailed,
    GatewayError,
    NoBackendAvailable,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from backends.upstream import Upstream, json_or_none
from gateway.attempt import Attempt, Call, T, Try, cancel_reason, open_upstream
from gateway.body import read_json_body, request_model
from gateway.continuation import Keep, Progress, Stitch, can_resume, refusal, resume_body
from gateway.disagg import decode_body, prefill_attempt, prefill_body
from gateway.headers import downstream_headers, upstream_headers
from gateway.keys import (
    ADMISSION,
    LIFECYCLE,
    LIMITER,
    METRICS,
    RELAY_FAST,
    REQUEST_ID_KEY,
    RETRY,
    ROUTER,
    SETTINGS,
    TRACER,
    UPSTREAM,
)
from gateway.limits.admission import AdmissionTicket
from gateway.limits.fairqueue import parse_priority
from gateway.limits.limiter import Grant
from gateway.limits.tokens import UsageFilter, usage_from_body, usage_plan, with_include_usage
from gateway.record import RequestRecord, finish
from gateway.relay import (
    Chunks,
    Ending,
    RelayResult,
    StreamBroken,
    end_stream,
    relay_body,
    relay_resumed,
    relay_stream,
)
from gateway.retry import RETRYABLE_STATUS, RetryPolicy
from gateway.rollout import ROLLOUT
from gateway.router import Route, Step
from gateway.tracing import annotate, end_attempt, parent_context

log = structlog.get_logger("gateway.request")

_EVENT_STREAM: Final = "text/event-stream"
_BUSY: Final = frozenset({429, 503})  # answers that tell the client when to come back
_rng = random.Random()


async def forward(request: web.Request, path: str) -> web.StreamResponse:
    app = request.app
    record = RequestRecord(request[REQUEST_ID_KEY], started=time.monotonic())
    limiter = app[LIMITER]
    grant: Grant | None = None
    try:
        principal = limiter.authenticate(request.headers)
        record.key = principal.id
        settings = app[SETTINGS]
        raw, doc = await read_json_body(
            request, settings.max_body_bytes, settings.client.body_timeout
        )
        model = record.model = request_model(doc)
        pool = app[ROUTER].pool
        choice = app[ROLLOUT].resolve(
            model, request.headers, usable=lambda p: pool.any_routable(p.model, p.backends)
        )
        if choice is not None:  # an alias (or a pool's own name): route in the chosen pool
            record.pool = choice.pool.name
            model = choice.pool.model
            if choice.rename is not None:  # opt-in, so serialising the body again is fine
                doc = {**doc, "model": model}
                raw = json.dumps(doc, separators=(",", ":")).encode()
        route = app[ROUTER].route(model, doc, request.headers, choice)
        grant = await limiter.admit(principal, doc)
        plan = usage_plan(doc)
        chat = path.endswith("/chat/completions")
        resumable = settings.continuation.enabled and refusal(doc, chat) is None
        call = Call(
            request,
            path,
            with_include_usage(doc, raw) if plan.inject else raw,
            upstream_headers(request.headers, record.request_id),
            record,
            strip_usage=plan.strip,
            extra_headers=grant.headers,
            choice=choice,
            resumable=doc if resumable else None,
        )
        ticket = await _wait_for_capacity(app, principal.id, principal.max_priority, request)
        try:
            return await _traced(call, route, doc)
        finally:
            if ticket is not None:
                ticket.release()
    except BaseException as exc:
        _classify(app, record, exc)
        raise
    finally:
        try:
            if grant is not None:
                # A request that never reached a backend used no tokens; one cut short before
                # its usage arrived keeps its reservation.
                spent = record.usage if record.sent else 0
                await asyncio.shield(limiter.finish(grant, spent))
        finally:
            finish(app, record)  # counted and logged even if cancelled while settling


def _classify(app: web.Application, record: RequestRecord, exc: BaseException) -> None:
    """Say truthfully in ``record`` how a request that raised ``exc`` ended (idempotent)."""
    if isinstance(exc, GatewayError):
        record.status, record.ending = exc.status, type(exc).__name__
    elif isinstance(exc, asyncio.CancelledError):
        if record.ending is None:  # before the relay: still queued, or waiting for the head
            record.ending = cancel_reason(app)
    elif isinstance(exc, Exception):  # a bug: the middleware answers 500 and logs it
        record.status, record.ending = 500, "internal_error"


async def _wait_for_capacity(
    app: web.Application, key: str, max_priority: int, request: web.Request
) -> AdmissionTicket | None:
    """Hold the request in the admission queue while every backend is saturated.

    A request let through takes its lease (``Router.pick``) before it next awaits.
    """
    admission = app[ADMISSION]
    if admission is None:
        return None
    settings = app[SETTINGS].limits.admission
    priority = parse_priority(request.headers.get(settings.priority_header), max_priority)
    started = time.monotonic()
    ticket = await admission.acquire(key, priority)
    if ticket.queued:
        app[METRICS].queue_wait.observe(time.monotonic() - started)
    return ticket


async def _traced(call: Call, route: Route, doc: dict[str, Any]) -> web.StreamResponse:
    app, record = call.request.app, call.record
    tracer = app[TRACER]
    if tracer is None:
        return await _serve(call, route, doc, None)
    with tracer.start_as_current_span(
        f"POST {call.path}",
        context=parent_context(call.request.headers),
        kind=SpanKind.SERVER,
        attributes={"gen_ai.request.model": record.model, "http.request.id": record.request_id},
    ) as span:
        try:
            return await _serve(call, route, doc, span)
        except BaseException as exc:
            _classify(app, record, exc)  # before the span is annotated
            raise
        finally:
            annotate(span, record)


async def _serve(
    call: Call, route: Route, doc: dict[str, Any], span: Span | None
) -> web.StreamResponse:
    """Run the route's steps: the prefill (if any), then the step that answers the client."""
    if route.prefill is None:
        return await _answered(call, route.serve, span)
    app, record = call.request.app, call.record
    metrics = app[METRICS]
    app[ROUTER].check(route.serve)  # no decode backend: fail before any prefill
    body = prefill_body(doc)
    prefilled = await _attempts(call, route.prefill, span, lambda t: prefill_attempt(t, body))
    if isinstance(prefilled, web.StreamResponse):  # the prefill refused the request (a 4xx)
        return prefilled
    answered = time.monotonic()
    decode = replace(call, body=decode_body(doc, call.body, prefilled))
    sent = time.monotonic()
    metrics.disagg_handoff.labels(record.model).observe(sent - answered)
    try:
        return await _answered(decode, route.serve, span)
    finally:
        if record.first_token_at is not None:
            metrics.disagg_decode_ttft.labels(record.model, record.backend).observe(
                record.first_token_at - sent
            )


async def _attempts(
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
    router, metrics = app[ROUTER], app[METRICS]
    retry = retry or app[RETRY]
    since = record.started if since is None else since
    tried: list[str] = list(exclude)
    last: UpstreamError | None = None
    while True:
        try:
            lease, candidates = router.pick(step, exclude=tried)
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
        t = Try(call, step, lease, n, may_retry, parent)
        error: BaseException | None = None
        try:
            return await attempt(t)
        except UpstreamError as exc:  # nothing reached the client
            error = last = exc
        except BaseException as exc:
            error = exc
            raise
        finally:
            if error is not None:
                t.tally.failed(error)
            outcome = t.tally.outcome()
            t.tally.judge(lease, outcome)
            lease.release()
            step.policy.on_result(step.facts, backend, outcome)
            cancelled = isinstance(error, asyncio.CancelledError)
            end_attempt(t.span, t.tally.status, None if cancelled else error or t.stream_error)
        reason = type(last).__name__
        if step.role is not None:
            metrics.disagg_failures.labels(step.name, backend, reason).inc()
        wait = retry.next_wait(n, time.monotonic() - since, _rng)
        if not may_retry or wait is None:
            raise last
        metrics.retries.labels(backend, reason).inc()
        log.info(
            "upstream_retry",
            step=step.name,
            backend=backend,
            error=last.message,
            wait_ms=round(wait * 1e3, 1),
        )
        await asyncio.sleep(wait)


async def _answered(call: Call, step: Step, span: Span | None) -> web.StreamResponse:
    """The client's answer from ``step``'s backends; a stream that breaks on the way goes on
    from another backend when it can (``_resume``)."""
    try:
        return await _attempts(call, step, span, _answer)
    except StreamBroken as broken:
        try:
            return await _resume(call, step, span, broken)
        except asyncio.CancelledError:  # the client left (or the gateway stops) meanwhile
            call.record.ending = cancel_reason(call.request.app)
            raise


async def _resume(
    call: Call, step: Step, span: Span | None, broken: StreamBroken
) -> web.StreamResponse:
    """Continue a broken stream on other backends, as many times as the settings allow.

    What cannot be continued faithfully (or finds no backend in time) ends as it did before
    continuations existed: vLLM's error event, then [DONE].
    """
    app, record = call.request.app, call.record
    settings, metrics = app[SETTINGS].continuation, app[METRICS]
    assert call.resumable is not None
    resp, progress = broken.response, broken.progress
    failed_on = [broken.backend]
    retry = replace(app[RETRY], max_attempts=settings.max_attempts, deadline=settings.deadline)
    while True:
        reason = _break_reason(broken.error)
        if progress.done or progress.finished is not None:  # only the stream's end was lost
            metrics.continuations.labels(reason, "complete").inc()
            await end_stream(resp, None, done=progress.done)
            record.ending = Ending.COMPLETE.value
            return resp
        why = can_resume(call.resumable, call.chat, progress)
        if why is None and record.continuations >= settings.max_continuations:
            why = "limit"
        if why is not None:
            metrics.continuations.labels(reason, why).inc()
            log.warning(
                "stream_not_continued", backend=broken.backend, error=broken.error.message, why=why
            )
            await end_stream(resp, broken.error)
            return resp
        record.continuations += 1
        log.info(
            "stream_continuing",
            backend=broken.backend,
            error=broken.error.message,
            sent_events=progress.events,
            continuation=record.continuations,
        )
        attempt = partial(_resume_attempt, resp=resp, progress=progress)
        try:
            done = await _attempts(
                call, step, span, attempt, retry=retry, since=time.monotonic(), exclude=failed_on
            )
        except StreamBroken as again:
            metrics.continuations.labels(reason, "broken").inc()
            broken = again
            failed_on.append(again.backend)
            continue
        except GatewayError as exc:  # no backend could take it
            metrics.continuations.labels(reason, "failed").inc()
            log.warning(
                "stream_not_continued", backend=broken.backend, error=exc.message, why="failed"
            )
            await end_stream(resp, broken.error)
            record.ending = Ending.UPSTREAM_ERROR.value
            return resp
        metrics.continuations.labels(reason, "continued").inc()
        return done


def _break_reason(error: UpstreamError) -> str:
    """The ``reason`` label of a broken stream."""
    if isinstance(error, BackendStalled):
        return "stalled"
    if isinstance(error, EngineFailed):
        return "engine_error"
    if isinstance(error, UpstreamTimeout):
        return "timeout"
    if isinstance(error, UpstreamProtocolError):
        return "protocol"
    return "unreachable"


async def _sent_tokens(t: Try, progress: Progress) -> int:
    """How many tokens the client has received: the stream's own token ids when it carries
    them, else the continuing backend's count of the text (its ``/tokenize``), else the
    events (one token each, a lower bound with speculative decoding or a stream interval)."""
    ids = progress.exact_ids
    if ids is not None and (ids or not progress.events):
        return len(ids)
    text = progress.generated
    if not text:
        return progress.events
    call = t.call
    app = call.request.app
    client = app[UPSTREAM]
    body = {"model": call.resumable and call.resumable.get("model"), "prompt": text}
    body["add_special_tokens"] = False
    raw = json.dumps(body).encode()
    try:
        async with asyncio.timeout(app[SETTINGS].continuation.tokenize_timeout):
            upstream = await client.open(t.lease.backend.spec, "/tokenize", raw, call.headers)
            try:
                answer = await client.read_body(upstream)
            finally:
                client.finish(upstream, complete=True)
    except (UpstreamError, TimeoutError):
        return progress.events
    count = json_or_none(answer) if upstream.status == 200 else None
    if isinstance(count, dict) and isinstance(count.get("count"), int):
        return int(count["count"])
    return progress.events


async def _resume_attempt(
    t: Try, *, resp: web.StreamResponse, progress: Progress
) -> web.StreamResponse:
    """One backend's try at the rest of a broken stream, into the client's open ``resp``."""
    call = t.call
    app, record = call.request.app, call.record
    client = app[UPSTREAM]
    assert call.resumable is not None
    sent = await _sent_tokens(t, progress)
    body = resume_body(call.resumable, call.chat, progress, sent)
    upstream = await open_upstream(t, json.dumps(body, separators=(",", ":")).encode())
    complete = False
    try:
        if upstream.status != 200 or upstream.content_type != _EVENT_STREAM:
            answer = await client.read_body(upstream)
            complete = True
            backend = t.lease.backend.id
            if upstream.status in RETRYABLE_STATUS:
                retry_after = upstream.headers.get("Retry-After")
                raise BackendRefused(backend, upstream.status, answer, retry_after=retry_after)
            raise UpstreamProtocolError(
                f"backend {backend} answered the continuation with {upstream.status}: "
                f"{answer[:200].decode(errors='replace')}"
            )
        stitch = Stitch(progress, sent)
        usage = UsageFilter(strip=call.strip_usage)
        result = RelayResult(ending=Ending.COMPLETE)
        rename = call.choice.rename if call.choice is not None else None
        chunks = Chunks(upstream.watch, result, usage, time.monotonic, rename)
        try:
            error = await relay_resumed(resp, upstream, stitch, chunks)
        finally:
            if usage.usage is not None:
                record.usage = usage.usage
            record.events += result.events
            t.tally.first_token_at = result.first_token_at
        if error is not None:
            t.tally.error = "stream"
            t.stream_error = error
            raise StreamBroken(resp, error, t.lease.backend.id, progress)
        complete = True
        t.tally.answered = True
        if usage.usage is not None:
            t.tally.tokens = usage.usage.completion_tokens - sent
        record.ending = Ending.COMPLETE.value
        record.ended_at = time.monotonic()
        return resp
    except asyncio.CancelledError:  # the client left: closing the upstream aborts it
        record.abort_reason = cancel_reason(app)
        raise
    finally:
        client.finish(upstream, complete=complete)


async def _answer(t: Try) -> web.StreamResponse:
    """One backend's try at the client's answer: relay it, or raise if nothing was sent."""
    call = t.call
    client = call.request.app[UPSTREAM]
    upstream = await open_upstream(t, call.body)
    complete = False
    try:
        status = upstream.status
        if status in RETRYABLE_STATUS and t.may_retry:  # "not now": another may take it
            body = await client.read_body(upstream)
            complete = True
            retry_after = upstream.headers.get("Retry-After")
            raise BackendRefused(t.lease.backend.id, status, body, retry_after=retry_after)
        call.record.status = status
        resp, complete = await _relay(t, upstream)
        call.record.ended_at = time.monotonic()
        return resp
    except asyncio.CancelledError:  # the client left: closing the upstream aborts it
        call.record.abort_reason = cancel_reason(call.request.app)
        raise
    finally:
        client.finish(upstream, complete=complete)


async def _relay(t: Try, upstream: Upstream) -> tuple[web.StreamResponse, bool]:
    """Relay the answer; return the response and whether it completed.

    Raises ``UpstreamError`` only if nothing reached the client; an error after that ends
    the stream with an error event and is kept in ``t.stream_error``.
    """
    call, tally = t.call, t.tally
    app, record = call.request.app, call.record
    headers = downstream_headers(upstream.headers, record.request_id)
    if upstream.status in _BUSY and "Retry-After" not in headers:
        headers["Retry-After"] = str(app[SETTINGS].retry_after_seconds)
    if call.extra_headers:
        headers.update(call.extra_headers)
    rename = call.choice.rename if call.choice is not None else None
    if upstream.content_type != _EVENT_STREAM:
        whole = await relay_body(upstream, headers, app[UPSTREAM], rename)
        record.ending = Ending.COMPLETE.value
        if isinstance(whole.body, bytes):
            record.usage = usage_from_body(whole.body)
        tally.answered = True
        tally.tokens = record.usage.completion_tokens if record.usage else None
        return whole, True
    usage = UsageFilter(strip=call.strip_usage)
    result = RelayResult(ending=Ending.UPSTREAM_ERROR)
    keep = None
    if call.resumable is not None:
        keep = Keep(call.chat, app[SETTINGS].continuation.compact_bytes)
    try:
        resp = await relay_stream(
            call.request,
            upstream,
            headers,
            time.monotonic,
            usage=usage,
            result=result,
            rename=rename,
            fast=app[RELAY_FAST],
            keep=keep,
        )
    except UpstreamTimeout:  # before anything reached the client
        record.abort_reason = "timeout"
        raise
    finally:  # also when cancelled: what reached the client is known
        record.usage = usage.usage
        record.first_token_at = tally.first_token_at = result.first_token_at
        record.events = result.events
        tally.tokens = usage.usage.completion_tokens if usage.usage else None
    record.ending = result.ending.value
    if result.ending is Ending.UPSTREAM_ERROR:
        tally.error = "stream"
        t.stream_error = result.error
        record.abort_reason = "timeout" if isinstance(result.error, UpstreamTimeout) else "error"
        if keep is not None:
            assert result.error is not None
            raise StreamBroken(resp, result.error, t.lease.backend.id, keep.progress())
        return resp, False
    if result.ending is Ending.CLIENT_DISCONNECT:
        record.abort_reason = cancel_reason(app)
        return resp, False
    tally.answered = True
    return resp, True


async def completions(request: web.Request) -> web.StreamResponse:
    return await forward(request, "/v1/completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await forward(request, "/v1/chat/completions")


async def list_models(request: web.Request) -> web.Response:
    names = set(request.app[ROUTER].pool.models()) | set(request.app[ROLLOUT].names())
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "llm-gateway"} for m in sorted(names)
    ]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    if request.app[LIFECYCLE].stopping:
        reason = "shutting down"
    elif not request.app[ROUTER].pool.ready():
        reason = "no routable backend"
    else:
        return web.json_response({"status": "ready"})
    return web.json_response(
        {"status": "not ready", "reason": reason},
        status=503,
        headers={"Retry-After": str(settings.retry_after_seconds)},
    )
