"""The request path, top to bottom: parse, admit, route, attempt, relay, release.

``forward`` reads the body once (``gateway.request.body``), authenticates and admits the request
(rate limits, then the admission queue while the fleet is saturated), and decides its route once
(``Router.route``): one step for a model served whole, by any of its backends or by the model pool
an alias chose; two for a model served by prefill and decode pools, the prefill's KV handed to the
decode (``gateway.request.disagg``). Every step runs the same attempt loop
(``gateway.request.attempt.attempts``): pick a backend, attempt, classify, release the lease, back
off, pick again among the backends not yet tried, for as long as the retry policy allows. Only an
attempt that has sent nothing to the client is retried; a backend that answers "not now" (429,
503...) is passed over while another is left, and its answer is the client's when none is. The
policy hears how each attempt ended (``Policy.on_result``). A stream that breaks after bytes reached
the client goes on from another backend (``gateway.request.resume``).

Every attempt holds one lease on a backend, released in one ``finally`` on every way out:
success, error, timeout and client disconnect (aiohttp cancels the handler when the client goes
away, because the server runs with ``handler_cancellation``). Closing the upstream response
early closes its connection, which is how vLLM learns to abort.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, replace
from typing import Any, Final, NoReturn

from aiohttp import web
from opentelemetry.trace import Span, SpanKind

from backends.errors import (
    BackendLacksEndpoint,
    BackendRefused,
    GatewayError,
    UpstreamTimeout,
    as_anthropic,
)
from backends.upstream.client import Upstream
from gateway.http import Handler, Request, StreamResponse
from gateway.keys import (
    ADMISSION,
    GENERATIONS,
    LIMITER,
    METRICS,
    RELAY_FAST,
    REQUEST_ID_KEY,
    RESPONSE_HOMES,
    ROUTER,
    SETTINGS,
    TOKENIZERS,
    TRACER,
    UPSTREAM,
)
from gateway.limits.admission import AdmissionTicket
from gateway.limits.fairqueue import parse_priority
from gateway.limits.keys import Principal
from gateway.limits.limiter import Grant
from gateway.limits.tokens import (
    UsageFilter,
    UsagePlan,
    usage_from_body,
    usage_plan,
    with_include_usage,
)
from gateway.observe.tracing import annotate, parent_context
from gateway.request.attempt import Call, Try, attempts, cancel_reason, open_upstream
from gateway.request.body import read_body, request_model
from gateway.request.continuation import Keep, Progress, refusal
from gateway.request.disagg import decode_body, prefill_attempt, prefill_body
from gateway.request.endpoints import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    MESSAGES,
    RESPONSES,
    Endpoint,
    is_route_missing,
)
from gateway.request.form import Upload
from gateway.request.generate import abort_ids, generate_refusal, generate_view, token_ids
from gateway.request.headers import (
    REQUEST_ID,
    downstream_headers,
    upstream_headers,
    valid_request_id,
)
from gateway.request.messages import chat_view
from gateway.request.messages_resume import MessagesProgress, messages_refusal
from gateway.request.record import RequestRecord, finish
from gateway.request.relay import (
    EVENT_STREAM,
    Ending,
    RelayResult,
    StreamBroken,
    outrun,
    relay_body,
    relay_stream,
)
from gateway.request.responses import with_response_id
from gateway.request.resume import resume
from gateway.request.retry import RETRYABLE_STATUS
from gateway.request.rollout import ROLLOUT, Choice
from gateway.request.router import Route, Step
from gateway.request.slo import meet_slo, parse_slo
from gateway.request.stored import home_of

_BUSY: Final = frozenset({429, 503})  # answers that tell the client when to come back
_NO_USAGE_PLAN: Final = UsagePlan(inject=False, strip=False)
_TOKEN_STREAMS: Final = (
    CHAT,
    COMPLETIONS,
    RESPONSES,
    MESSAGES,
    GENERATE,
)  # "stream": true streams tokens


async def forward(request: Request, endpoint: Endpoint) -> StreamResponse:
    """Route one model-addressed JSON request (``endpoint``: what it is,
    ``gateway.request.endpoints``) to a backend serving its model, under the limits, and relay the
    answer."""
    app = request.app
    record = RequestRecord(
        request[REQUEST_ID_KEY], started=time.monotonic(), endpoint=endpoint.name
    )
    limiter = app[LIMITER]
    grant: Grant | None = None
    upload: Upload | None = None
    try:
        principal = limiter.authenticate(request.headers)
        record.key = principal.id
        settings = app[SETTINGS]
        raw, doc = await read_body(request, endpoint, settings)
        upload = raw if isinstance(raw, Upload) else None
        asked = record.model = request_model(doc)
        response_id = pin = None
        if endpoint is RESPONSES:
            assert isinstance(raw, bytes)  # a JSON endpoint
            response_id, pin, doc, raw = await _stored_response(app, doc, raw)
        pool = app[ROUTER].pool
        routed = await _routed(
            request, asked, doc, raw, endpoint, objective=principal.objective, pin=pin
        )
        record.pool = routed.choice.pool.name if routed.choice is not None else None
        slo_header = settings.latency.slo_header
        slo = parse_slo(request.headers.get(slo_header)) if slo_header else None
        grant = await limiter.admit(principal, routed.view, generates=endpoint.generates)
        if slo is not None:
            await meet_slo(app, routed.route.serve, slo, _priority(app, request, principal))
        ticket = await _wait_for_capacity(app, principal.id, principal.max_priority, request)
        try:
            choice = routed.choice
            if choice is not None and not pool.any_routable(
                choice.pool.model, choice.pool.backends
            ):
                # The chosen pool lost its last usable backend while the request waited (for
                # its limits, in the admission queue): choose among the alias's pools again.
                routed = await _routed(
                    request, asked, doc, raw, endpoint, objective=principal.objective, pin=pin
                )
                record.pool = routed.choice.pool.name if routed.choice is not None else None
            call = _call(
                request, endpoint, routed, record=record, grant=grant, response_id=response_id
            )
            return await _findable(call, routed, principal.id)
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
            if upload is not None:
                upload.close()
            finish(app, record)  # counted and logged even if cancelled while settling


async def _stored_response(
    app: web.Application, doc: dict[str, Any], raw: bytes
) -> tuple[str | None, str | None, dict[str, Any], bytes]:
    """A Responses request: the id to remember its backend under (None when not stored),
    the backend it must go to (the one holding its ``previous_response_id``), and the body
    that names the id."""
    response_id, doc, raw = with_response_id(doc, raw)
    pin = await home_of(app, doc.get("previous_response_id"), "previous_response_id")
    return (None if doc.get("store", True) is False else response_id), pin, doc, raw


@dataclass(frozen=True, slots=True)
class _Routed:
    choice: Choice | None  # the alias's pool, if the model named one
    doc: dict[str, Any]  # the body as the backend gets it (renamed for a pool if opted in)
    raw: bytes | Upload
    route: Route
    view: dict[str, Any]  # the body as the engine reads it (a Messages body: as a chat)


async def _routed(
    request: Request,
    asked: str,
    doc: dict[str, Any],
    raw: bytes | Upload,
    endpoint: Endpoint,
    *,
    objective: str | None = None,
    pin: str | None = None,
) -> _Routed:
    """Where the request for ``asked`` goes: an alias's pool (and the model it serves), the
    route's steps, and the facts its policy asked for. Raises ``ModelNotFound`` early."""
    app = request.app
    router = app[ROUTER]
    pool = router.pool
    choice = app[ROLLOUT].resolve(
        asked, request.headers, usable=lambda p: pool.any_routable(p.model, p.backends)
    )
    model = asked
    if choice is not None:  # an alias (or a pool's own name): route in the chosen pool
        model = choice.pool.model
        if choice.rename is not None:  # opt-in, so serialising the body again is fine
            doc = {**doc, "model": model}
            if isinstance(raw, Upload):
                raw = raw.replaced("model", model)
            else:
                raw = json.dumps(doc, separators=(",", ":")).encode()
    view = _view(endpoint, doc)
    tokens = None
    # precise_prefix: the prompt's blocks as the engine keys them. A salted request's blocks
    # are hashed with its salt: no other request's blocks are its prefix.
    tokenizers = app[TOKENIZERS]
    if endpoint is GENERATE:
        tokens = token_ids(doc) if router.wants_tokens and "cache_salt" not in doc else None
    elif (
        router.wants_tokens
        and tokenizers is not None
        and endpoint in (CHAT, COMPLETIONS, MESSAGES)
        and "cache_salt" not in doc
    ):
        tokens = await tokenizers.tokens(
            model, "completions" if endpoint is COMPLETIONS else "chat", view
        )
    route = router.route(
        model,
        view,
        request.headers,
        choice=choice,
        tokens=tokens,
        objective=objective,
        endpoint=endpoint.name,
        pin=pin,
    )
    return _Routed(choice, doc, raw, route, view)


def _view(endpoint: Endpoint, doc: dict[str, Any]) -> dict[str, Any]:
    """The body as the rest of the gateway reads one (a chat's or a completion's fields)."""
    if endpoint.dialect == "anthropic":
        return chat_view(doc)
    if endpoint is GENERATE:
        return generate_view(doc)
    return doc


def _resumable(endpoint: Endpoint, doc: dict[str, Any]) -> bool:
    """Whether a stream of this request may be continued on another backend if it breaks."""
    if endpoint is MESSAGES:
        return messages_refusal(doc) is None
    if endpoint is GENERATE:
        return generate_refusal(doc) is None
    return endpoint in (CHAT, COMPLETIONS) and refusal(doc, endpoint is CHAT) is None


def _call(
    request: Request,
    endpoint: Endpoint,
    routed: _Routed,
    *,
    record: RequestRecord,
    grant: Grant,
    response_id: str | None,
) -> Call:
    """What each attempt sends: the body (asking for usage where a JSON stream can carry it)
    and whether the stream may be continued on another backend (chat and completions)."""
    doc, body = routed.doc, routed.raw
    plan = _NO_USAGE_PLAN
    if endpoint.stream == "data" and isinstance(body, bytes):
        plan = usage_plan(doc)
        if plan.inject:
            body = with_include_usage(doc, body)
    resumable = request.app[SETTINGS].continuation.enabled and _resumable(endpoint, doc)
    return Call(
        request,
        request.path,
        body,
        upstream_headers(request.headers, _upstream_id(request, endpoint, doc, record)),
        record,
        strip_usage=plan.strip,
        extra_headers=grant.headers,
        choice=routed.choice,
        resumable=doc if resumable else None,
        endpoint=endpoint,
        response_id=response_id,
        streamed=endpoint in _TOKEN_STREAMS and doc.get("stream") is True,
    )


async def _findable(call: Call, routed: _Routed, owner: str) -> StreamResponse:
    """Serve ``call``; a token-in generation where its abort route can find it meanwhile (by
    the id it goes upstream with)."""
    if call.endpoint is not GENERATE:
        return await _traced(call, routed.route, routed.doc)
    generations = call.request.app[GENERATIONS]
    aborts = abort_ids(call.headers[REQUEST_ID])
    generations.started(aborts, owner, call.record)
    try:
        return await _traced(call, routed.route, routed.doc)
    finally:
        generations.ended(aborts)


def _upstream_id(
    request: Request, endpoint: Endpoint, doc: dict[str, Any], record: RequestRecord
) -> str:
    """The X-Request-Id the backend gets: the request's, but for a token-in generation
    without the header, the body's ``request_id``: vLLM names the generation after the
    header, else the body's id, and the one the client chose is the one it aborts by."""
    if endpoint is GENERATE and REQUEST_ID not in request.headers:
        return valid_request_id(doc.get("request_id")) or record.request_id
    return record.request_id


def _classify(app: web.Application, record: RequestRecord, exc: BaseException) -> None:
    """Say truthfully in ``record`` how a request that raised ``exc`` ended (idempotent)."""
    if isinstance(exc, GatewayError):
        record.status, record.ending = exc.status, type(exc).__name__
    elif isinstance(exc, asyncio.CancelledError):
        if record.ending is None:  # before the relay: still queued, or waiting for the head
            record.ending = cancel_reason(app)
    elif isinstance(exc, Exception):  # a bug: the middleware answers 500 and logs it
        record.status, record.ending = 500, "internal_error"


def _priority(app: web.Application, request: Request, principal: Principal) -> int:
    header = app[SETTINGS].limits.admission.priority_header
    return parse_priority(request.headers.get(header), principal.max_priority)


async def _wait_for_capacity(
    app: web.Application, key: str, max_priority: int, request: Request
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


async def _traced(call: Call, route: Route, doc: dict[str, Any]) -> StreamResponse:
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
) -> StreamResponse:
    """Run the route's steps: the prefill (if any), then the step that answers the client."""
    if route.prefill is None:
        return await _answered(call, route.serve, span)
    app, record = call.request.app, call.record
    metrics = app[METRICS]
    app[ROUTER].check(route.serve)  # no decode backend: fail before any prefill
    body = prefill_body(doc)
    prefilled = await attempts(call, route.prefill, span, lambda t: prefill_attempt(t, body))
    if isinstance(prefilled, StreamResponse):  # the prefill refused the request (a 4xx)
        return prefilled
    answered = time.monotonic()
    assert isinstance(call.body, bytes)  # chat and completions only (``Router.route``)
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


async def _answered(call: Call, step: Step, span: Span | None) -> StreamResponse:
    """The client's answer from ``step``'s backends; a stream that breaks on the way goes on
    from another backend when it can (``_resume``)."""
    try:
        return await attempts(call, step, span, _answer)
    except StreamBroken as broken:
        try:
            return await resume(call, step, span, broken)
        except asyncio.CancelledError:  # the client left (or the gateway stops) meanwhile
            call.record.ending = cancel_reason(call.request.app)
            raise


async def _answer(t: Try) -> StreamResponse:
    """One backend's try at the client's answer: relay it, or raise if nothing was sent."""
    call = t.call
    client = call.request.app[UPSTREAM]
    upstream = await open_upstream(t, call.body)
    complete = False
    try:
        status = upstream.status
        read: bytes | None = None
        if status in (403, 404):  # no such model or response, or no such route: the body tells
            read = await client.read_body(upstream)
            complete = True
            if is_route_missing(status, read):  # the other kind of vLLM server
                _lacks(t)
        if status in RETRYABLE_STATUS and (t.may_retry or t.rivalled()):  # another may take it
            body = await client.read_body(upstream)
            complete = True
            retry_after = upstream.headers.get("Retry-After")
            raise BackendRefused(t.lease.backend.id, status, body, retry_after=retry_after)
        if status >= 400 and call.endpoint.dialect == "anthropic":  # its clients parse that
            if read is None:
                read = await client.read_body(upstream)
                complete = True
            read = json.dumps(as_anthropic(status, read), separators=(",", ":")).encode()
        call.record.status = status
        if call.response_id is not None and status == 200:  # follow-ups must come back here
            await call.request.app[RESPONSE_HOMES].remember(call.response_id, t.lease.backend.id)
        resp, done = await _relay(t, upstream, read)
        complete = complete or done
        call.record.ended_at = time.monotonic()
        return resp
    except asyncio.CancelledError:  # the client left: closing the upstream aborts it
        call.record.abort_reason = cancel_reason(call.request.app)
        raise
    finally:
        client.finish(upstream, complete=complete)


async def _relay(
    t: Try, upstream: Upstream, read: bytes | None = None
) -> tuple[StreamResponse, bool]:
    """Relay the answer (``read``: its body, if already read); return the response and
    whether it completed.

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
    if read is not None or upstream.content_type != EVENT_STREAM:
        if t.race is not None and t.interrupt is not None and not t.interrupt.take():
            raise outrun(upstream.backend)  # its rival took the client first
        whole = await relay_body(upstream, headers, app[UPSTREAM], rename, read)
        record.ending = Ending.COMPLETE.value
        if isinstance(whole.body, bytes):
            record.usage = usage_from_body(whole.body)
        tally.answered = True
        tally.tokens = record.usage.completion_tokens if record.usage else None
        return whole, True
    usage = UsageFilter(strip=call.strip_usage)
    result = RelayResult(
        ending=Ending.UPSTREAM_ERROR,
        on_first=t.expected.pending.done if t.expected is not None else None,
        dialect=call.endpoint.dialect,
    )
    keep = None
    if call.resumable is not None:
        progress: Progress | MessagesProgress = (
            MessagesProgress() if call.endpoint is MESSAGES else Progress(chat=call.chat)
        )
        keep = Keep(progress, app[SETTINGS].continuation.compact_bytes)
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
        tally.first_token_at = result.first_token_at
        tally.tokens = usage.usage.completion_tokens if usage.usage else None
        if not t.outrun():  # the client's answer is this attempt's (not its rival's)
            record.usage = usage.usage
            record.first_token_at = result.first_token_at
            record.events = result.events
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


def _lacks(t: Try) -> NoReturn:
    """The backend has no route for the endpoint: remember it, and try another."""
    call, backend = t.call, t.lease.backend.id
    endpoint = call.endpoint.name
    call.request.app[ROUTER].pool.record_lacks(backend, endpoint)
    raise BackendLacksEndpoint(
        f"No backend serving `{call.record.model}` offers the {endpoint} endpoint "
        f"({backend} answered that it has no {call.path}).",
        param="model",
    )


def route_endpoint(endpoint: Endpoint) -> Handler:
    """The request handler of one of ``gateway.request.endpoints``' JSON endpoints."""

    async def handler(request: Request) -> StreamResponse:
        return await forward(request, endpoint)

    return handler
