"""The request path: parse, pick, forward, relay, release. Read it top to bottom.

Every attempt holds one lease on a backend, released in one ``finally`` on every way out:
success, error, timeout and client disconnect (aiohttp cancels the handler when the client
goes away, because the server runs with ``handler_cancellation``). Closing the upstream
response early closes its connection, which is how vLLM learns to abort. An attempt that
fails before anything has reached the client is retried on another backend.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Awaitable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

import structlog
from aiohttp import web
from multidict import CIMultiDict
from opentelemetry.trace import Span, SpanKind, set_span_in_context

from backends.errors import (
    BodyTimeout,
    BodyTooLarge,
    GatewayError,
    InvalidRequest,
    NoBackendAvailable,
    UpstreamError,
    UpstreamTimeout,
)
from backends.pool import Lease
from backends.upstream import Upstream
from gateway.disagg import DISAGG, Picker
from gateway.headers import downstream_headers, upstream_headers
from gateway.keys import (
    ADMISSION,
    LIFECYCLE,
    LIMITER,
    METRICS,
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
from gateway.relay import Ending, RelayResult, relay_body, relay_stream
from gateway.retry import RETRYABLE_STATUS
from gateway.rollout import ROLLOUT, Choice
from gateway.router import Router
from gateway.tracing import annotate, attempt_span, end_attempt, inject, parent_context
from policies import BackendSnapshot, PrefixHasher, RouteFacts

log = structlog.get_logger("gateway.request")

_EVENT_STREAM = "text/event-stream"
_rng = random.Random()


class _RetryableStatus(Exception):
    def __init__(self, status: int) -> None:
        self.status = status


async def read_json_body(
    request: web.Request, limit: int, within: float
) -> tuple[bytes, dict[str, Any]]:
    """The raw body (forwarded as is) and its parsed object; 400/408/413 on bad input."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"Request body is larger than the limit of {limit} bytes.")
    try:
        async with asyncio.timeout(within):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise BodyTooLarge(f"Request body is larger than the limit of {limit} bytes.") from exc
    except TimeoutError as exc:
        raise BodyTimeout(f"The request body did not arrive within {within:g}s.") from exc
    return raw, parse_json_object(raw)


# ``\uD800``-``\uDFFF`` escapes: JSON lets them stand alone, Unicode text (and UTF-8) does not.
_SURROGATE_ESCAPE: Final = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A body as a JSON object of valid Unicode text; ``InvalidRequest`` (400) otherwise.

    Everything a client can send that the rest of the gateway could not handle stops here:
    bytes that are not UTF-8 JSON, nesting deeper than Python's parser goes, lone surrogates
    (they cannot be encoded again: prompt hashing, logs, metrics), anything but an object.
    """
    if not raw:
        raise InvalidRequest(
            "The request body is empty; expected a JSON object.", code="invalid_json"
        )
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(
            f"We could not parse the JSON body of your request: {exc}.", code="invalid_json"
        ) from exc
    except RecursionError as exc:
        raise InvalidRequest(
            "The JSON body of your request is nested too deeply.", code="invalid_json"
        ) from exc
    if not isinstance(doc, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw) is not None:
        try:  # a valid pair was joined by the parser; a lone half was not
            json.dumps(doc, ensure_ascii=False).encode()
        except UnicodeEncodeError as exc:
            raise InvalidRequest(
                "The JSON body of your request holds a lone UTF-16 surrogate (\\uD800-\\uDFFF),"
                " which is not valid Unicode text.",
                code="invalid_json",
            ) from exc
    return doc


def route_facts(
    doc: dict[str, Any], policy: object = None, headers: Mapping[str, str] | None = None
) -> RouteFacts:
    """What the policy may know of the request; only what ``policy`` asks for is computed.

    A policy with a ``prefix_hasher`` gets the prompt's block hashes (and its stable key if
    ``prefix_keyed``), one with a ``session_header`` that header's value
    (``policies.prefix_affinity``).
    """
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest(
            "You must provide a model parameter (a non-empty string).", param="model"
        )
    hasher = getattr(policy, "prefix_hasher", None)
    header = getattr(policy, "session_header", None)
    hashes, key = (
        hasher.facts(model, doc, keyed=getattr(policy, "prefix_keyed", False) is True)
        if isinstance(hasher, PrefixHasher)
        else ((), None)
    )
    return RouteFacts(
        model=model,
        session_key=headers.get(header) if isinstance(header, str) and headers else None,
        prefix_hashes=hashes,
        prefix_key=key,
    )


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
        facts = route_facts(doc, app[ROUTER].policy, request.headers)
        record.model = facts.model
        choice = app[ROLLOUT].resolve(facts.model, request.headers)
        if choice is not None:  # an alias (or a pool's own name): route in the chosen pool
            record.pool = choice.pool.name
            facts = replace(facts, model=choice.pool.model)
            if choice.rename is not None:  # opt-in, so serialising the body again is fine
                doc = {**doc, "model": choice.pool.model}
                raw = json.dumps(doc, separators=(",", ":")).encode()
        grant = await limiter.admit(principal, doc)
        plan = usage_plan(doc)
        call = _Call(
            request,
            path,
            with_include_usage(doc, raw) if plan.inject else raw,
            upstream_headers(request.headers, record.request_id),
            record,
            strip_usage=plan.strip,
            extra_headers=grant.headers,
            choice=choice,
        )
        ticket = await _wait_for_capacity(app, principal.id, principal.max_priority, request)
        try:
            return await _traced(call, facts)
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


def cancel_reason(app: web.Application) -> str:
    """Why a handler was cancelled: its client left, or the gateway is shutting down."""
    return "shutdown" if app[LIFECYCLE].stopping else "client_disconnect"


async def _wait_for_capacity(
    app: web.Application, key: str, max_priority: int, request: web.Request
) -> AdmissionTicket | None:
    """Hold the request in the admission queue while every backend is saturated."""
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


async def _traced(call: _Call, facts: RouteFacts) -> web.StreamResponse:
    app, record = call.request.app, call.record
    tracer = app[TRACER]
    if tracer is None:
        return await _route(call, facts, None)
    with tracer.start_as_current_span(
        f"POST {call.path}",
        context=parent_context(call.request.headers),
        kind=SpanKind.SERVER,
        attributes={"gen_ai.request.model": facts.model, "http.request.id": record.request_id},
    ) as span:
        try:
            return await _route(call, facts, span)
        except BaseException as exc:
            _classify(app, record, exc)  # before the span is annotated
            raise
        finally:
            annotate(span, record)


async def _route(
    call: _Call, facts: RouteFacts, span: Span | None, pick: Picker | None = None
) -> web.StreamResponse:
    """Pick a backend and try it; on a failure before the first byte, try another.

    A model served by prefill and decode pools goes through ``gateway.disagg``, which runs
    the prefill step and comes back here for the decode step with the decode pool's ``pick``.
    """
    app, record = call.request.app, call.record
    router, retry = app[ROUTER], app[RETRY]
    if pick is None and call.choice is not None:
        pick = _pool_picker(router, call.choice.pool.backends)
    if pick is None:
        disagg = app.get(DISAGG)
        if disagg is not None and disagg.serves(facts.model):

            def decode(body: bytes, f: RouteFacts, p: Picker) -> Awaitable[web.StreamResponse]:
                return _route(replace(call, body=body), f, span, p)

            return await disagg.route(call, facts, span, decode)
        pick = router.pick
    last_error: GatewayError | None = None
    while True:
        try:
            lease, candidates = pick(facts, exclude=record.backends)
        except NoBackendAvailable:
            if last_error is not None:  # every candidate failed: say how the last did
                raise last_error from None
            raise
        record.backends.append(lease.backend.id)
        if not record.candidates:
            record.candidates = candidates
        may_retry = len(record.backends) < retry.max_attempts
        try:
            return await _attempt(call, lease, may_retry, span)
        except (UpstreamError, _RetryableStatus) as exc:
            last_error = (
                exc
                if isinstance(exc, UpstreamError)
                else UpstreamError(f"backend answered {exc.status}")
            )
            wait = retry.next_wait(len(record.backends), time.monotonic() - record.started, _rng)
            if wait is None:
                raise last_error from None
            app[METRICS].retries.labels(lease.backend.id, type(last_error).__name__).inc()
            log.info(
                "upstream_retry",
                request_id=record.request_id,
                backend=lease.backend.id,
                error=last_error.message,
                wait_ms=round(wait * 1e3, 1),
            )
            await asyncio.sleep(wait)
        finally:
            lease.release()


def _pool_picker(router: Router, only: frozenset[str]) -> Picker:
    """``router.pick`` among one model pool's backends."""

    def pick(
        facts: RouteFacts, exclude: Collection[str] = ()
    ) -> tuple[Lease, list[BackendSnapshot]]:
        return router.pick(facts, exclude, only)

    return pick


@dataclass(frozen=True, slots=True)
class _Call:
    """What every attempt of one request sends."""

    request: web.Request
    path: str
    body: bytes
    headers: CIMultiDict[str]
    record: RequestRecord
    strip_usage: bool = False
    extra_headers: dict[str, str] | None = None  # added to the client's response
    choice: Choice | None = None  # the model pool chosen for an alias


async def _attempt(
    call: _Call, lease: Lease, may_retry: bool, parent: Span | None
) -> web.StreamResponse:
    """One backend's try. Raises (UpstreamError, _RetryableStatus) only if nothing was sent."""
    app, record = call.request.app, call.record
    client = app[UPSTREAM]
    headers, span = call.headers, None
    if parent is not None:
        span = attempt_span(app[TRACER], parent, lease.backend.id, len(record.backends))
        headers = CIMultiDict(headers)
        inject(headers, set_span_in_context(span))
    try:
        upstream = await client.open(lease.backend.spec, call.path, call.body, headers)
    except UpstreamError as exc:
        lease.failed()
        end_attempt(span, 0, exc)
        raise
    record.sent = True
    status = upstream.response.status
    complete = False
    try:
        if status >= 500:
            lease.failed()
        if may_retry and status in RETRYABLE_STATUS:
            raise _RetryableStatus(status)
        record.status = status
        resp, complete, error = await _relay(call, upstream, lease)
        if complete and status < 500:
            lease.succeeded()
        record.ended_at = time.monotonic()
        end_attempt(span, status, error)
        return resp
    except asyncio.CancelledError:
        record.abort_reason = cancel_reason(app)
        end_attempt(span, status, None)
        raise
    except BaseException as exc:
        end_attempt(span, status, exc)
        raise
    finally:
        client.finish(upstream, complete=complete)


async def _relay(
    call: _Call, upstream: Upstream, lease: Lease
) -> tuple[web.StreamResponse, bool, UpstreamError | None]:
    """Relay the answer; return the response, whether it completed, and a mid-stream error."""
    record = call.record
    headers = downstream_headers(upstream.response.headers, record.request_id)
    if call.extra_headers:
        headers.update(call.extra_headers)
    rename = call.choice.rename if call.choice is not None else None
    try:
        if upstream.response.content_type != _EVENT_STREAM:
            whole = await relay_body(upstream, headers, call.request.app[UPSTREAM], rename)
            record.ending = Ending.COMPLETE.value
            if isinstance(whole.body, bytes):
                record.usage = usage_from_body(whole.body)
            return whole, True, None
        usage = UsageFilter(strip=call.strip_usage)
        result = RelayResult(ending=Ending.UPSTREAM_ERROR)
        try:
            resp = await relay_stream(
                call.request,
                upstream,
                headers,
                time.monotonic,
                usage=usage,
                result=result,
                rename=rename,
            )
        finally:  # also when cancelled: what reached the client is known
            record.usage = usage.usage
            record.first_token_at = result.first_token_at
            record.events = result.events
    except UpstreamError as exc:  # before anything reached the client
        lease.failed()
        if isinstance(exc, UpstreamTimeout):
            record.abort_reason = "timeout"
        raise
    record.ending = result.ending.value
    if result.ending is Ending.UPSTREAM_ERROR:
        lease.failed()
        record.abort_reason = "timeout" if isinstance(result.error, UpstreamTimeout) else "error"
        return resp, False, result.error
    if result.ending is Ending.CLIENT_DISCONNECT:
        record.abort_reason = cancel_reason(call.request.app)
    return resp, result.ending is Ending.COMPLETE, None


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
