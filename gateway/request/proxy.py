"""The request path, top to bottom: parse, admit, route, attempt, relay, release.

A streamed chat request, socket to socket, goes through these modules and no others call
back up:

1. ``gateway.http.protocol``: the connection parses the head and starts the handler task
   (``gateway.request.middleware.entry``: the request id, the route, errors in the endpoint's
   shape).
2. ``forward`` (here): reads the body once (``gateway.request.body``), authenticates and admits
   the request (rate limits, then the admission queue while the fleet is saturated), and
   decides its route once (``Router.route``): one step for a model served whole, by any of its
   backends or by the model pool an alias chose; two for a model served by prefill and decode
   pools, the prefill's KV handed to the decode (``gateway.request.disagg``).
3. ``gateway.request.attempt.attempts``: the loop every step runs: pick a backend, attempt,
   judge, release the lease, back off, pick again among the backends not yet tried, for as long
   as the retry policy allows. It returns the attempt's result or raises what ended the last.
4. ``gateway.request.answer.answer``: one backend's try at the client's answer: send
   (``gateway.request.send``), judge the head, relay (``gateway.request.relay``). Only an
   attempt that has sent nothing to the client is retried; a backend that answers "not now"
   (429, 503...) is passed over while another is left, and its answer is the client's when
   none is.
5. A stream that breaks after bytes reached the client raises ``StreamBroken`` out of the loop;
   ``gateway.request.resume`` goes on from another backend, through the same loop.

The request's state is ``Call`` (what every attempt sends), ``Try`` (one attempt) and
``RequestRecord`` (what is logged and counted once it ends) (``gateway.request.call``). Every
attempt holds one lease on a backend, released in one ``finally`` on every way out: success,
error, timeout and client disconnect (the connection cancels the handler task when its client
goes away). Closing the upstream response early closes its connection, which is how vLLM learns
to abort.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Final

from opentelemetry.trace import Span, SpanKind

from backends.errors import (
    GatewayError,
)
from gateway.http import Handler, Request, StreamResponse
from gateway.keys import REQUEST_ID_KEY
from gateway.limits.admission import AdmissionTicket
from gateway.limits.fairqueue import parse_priority
from gateway.limits.keys import Principal
from gateway.limits.limiter import Grant
from gateway.limits.tokens import (
    UsagePlan,
    usage_plan,
    with_include_usage,
)
from gateway.observe.tracing import annotate, parent_context
from gateway.request.answer import answer
from gateway.request.attempt import attempts
from gateway.request.body import read_body, request_model
from gateway.request.call import Call, StreamBroken
from gateway.request.continuation import refusal
from gateway.request.disagg import decode_body, prefill_attempt, prefill_body
from gateway.request.endpoints import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    MESSAGES,
    RESPONSES,
    Endpoint,
)
from gateway.request.form import Upload
from gateway.request.generate import abort_ids, generate_refusal, generate_view, token_ids
from gateway.request.headers import (
    REQUEST_ID,
    upstream_headers,
    valid_request_id,
)
from gateway.request.messages import chat_view
from gateway.request.messages_resume import messages_refusal
from gateway.request.priority import PRIORITY_ENDPOINTS, engine_priority
from gateway.request.record import RequestRecord, finish
from gateway.request.responses import with_response_id
from gateway.request.resume import resume
from gateway.request.rollout import Choice
from gateway.request.router import Route, Step
from gateway.request.services import Services
from gateway.request.slo import meet_slo, parse_slo
from gateway.request.stored import home_of

_NO_USAGE_PLAN: Final = UsagePlan(inject=False, strip=False)
_TOKEN_STREAMS: Final = (
    CHAT,
    COMPLETIONS,
    RESPONSES,
    MESSAGES,
    GENERATE,
)  # "stream": true streams tokens


async def forward(request: Request, endpoint: Endpoint, svc: Services) -> StreamResponse:
    """Route one model-addressed JSON request (``endpoint``: what it is,
    ``gateway.request.endpoints``) to a backend serving its model, under the limits, and relay the
    answer."""
    record = RequestRecord(
        request[REQUEST_ID_KEY], started=time.monotonic(), endpoint=endpoint.name
    )
    limiter = svc.limiter
    grant: Grant | None = None
    upload: Upload | None = None
    try:
        principal = limiter.authenticate(request.headers)
        record.key = principal.id
        settings = svc.settings
        raw, doc = await read_body(request, endpoint, settings)
        upload = raw if isinstance(raw, Upload) else None
        asked = record.model = request_model(doc)
        response_id = pin = None
        if endpoint is RESPONSES:
            assert isinstance(raw, bytes)  # a JSON endpoint
            response_id, pin, doc, raw = await _stored_response(svc, doc, raw)
        pool = svc.router.pool
        route = partial(
            _routed,
            request,
            svc,
            asked,
            doc,
            raw=raw,
            endpoint=endpoint,
            pin=pin,
            objective=principal.objective,
        )
        routed = await route()
        record.pool = routed.choice.pool.name if routed.choice is not None else None
        grant = await limiter.admit(principal, routed.view, generates=endpoint.generates)
        priority = record.priority = await _prioritised(svc, request, principal, routed.route)
        ticket = await _wait_for_capacity(svc, principal, priority)
        try:
            choice = routed.choice
            if choice is not None and not pool.any_routable(
                choice.pool.model, choice.pool.backends
            ):
                # The chosen pool lost its last usable backend while the request waited (for
                # its limits, in the admission queue): choose among the alias's pools again.
                routed = await route()
                record.pool = routed.choice.pool.name if routed.choice is not None else None
            call = _call(
                request,
                svc,
                endpoint,
                routed,
                record=record,
                grant=grant,
                response_id=response_id,
                engine_priority=engine_priority(routed.doc, request.headers, principal, priority),
            )
            return await _findable(call, routed, principal.id)
        finally:
            if ticket is not None:
                ticket.release()
    except BaseException as exc:
        _classify(svc, record, exc)
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
            finish(svc, record)  # counted and logged even if cancelled while settling


async def _stored_response(
    svc: Services, doc: dict[str, Any], raw: bytes
) -> tuple[str | None, str | None, dict[str, Any], bytes]:
    """A Responses request: the id to remember its backend under (None when not stored),
    the backend it must go to (the one holding its ``previous_response_id``), and the body
    that names the id."""
    response_id, doc, raw = with_response_id(doc, raw)
    pin = await home_of(svc, doc.get("previous_response_id"), "previous_response_id")
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
    svc: Services,
    asked: str,
    doc: dict[str, Any],
    *,
    raw: bytes | Upload,
    endpoint: Endpoint,
    objective: str | None = None,
    pin: str | None = None,
) -> _Routed:
    """Where the request for ``asked`` goes: an alias's pool (and the model it serves), the
    route's steps, and the facts its policy asked for. Raises ``ModelNotFound`` early."""
    router = svc.router
    pool = router.pool
    choice = svc.rollout.resolve(
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
    tokenizers = svc.tokenizers
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
    svc: Services,
    endpoint: Endpoint,
    routed: _Routed,
    *,
    record: RequestRecord,
    grant: Grant,
    response_id: str | None,
    engine_priority: int | None,
) -> Call:
    """What each attempt sends: the body (asking for usage where a JSON stream can carry it)
    and whether the stream may be continued on another backend (chat and completions)."""
    doc, body = routed.doc, routed.raw
    plan = _NO_USAGE_PLAN
    if endpoint.stream == "data" and isinstance(body, bytes):
        plan = usage_plan(doc)
        if plan.inject:
            body = with_include_usage(doc, body)
    resumable = svc.settings.continuation.enabled and _resumable(endpoint, doc)
    return Call(
        request,
        svc,
        request.path,
        body,
        upstream_headers(
            request.headers,
            _upstream_id(request, endpoint, doc, record),
            own_priority=engine_priority is None,
        ),
        record,
        strip_usage=plan.strip,
        extra_headers=grant.headers,
        choice=routed.choice,
        resumable=doc if resumable else None,
        endpoint=endpoint,
        response_id=response_id,
        streamed=endpoint in _TOKEN_STREAMS and doc.get("stream") is True,
        engine_priority=engine_priority if endpoint in PRIORITY_ENDPOINTS else None,
    )


async def _findable(call: Call, routed: _Routed, owner: str) -> StreamResponse:
    """Serve ``call``; a token-in generation where its abort route can find it meanwhile (by
    the id it goes upstream with)."""
    if call.endpoint is not GENERATE:
        return await _traced(call, routed.route, routed.doc)
    generations = call.svc.generations
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


def _classify(svc: Services, record: RequestRecord, exc: BaseException) -> None:
    """Say truthfully in ``record`` how a request that raised ``exc`` ended (idempotent)."""
    if isinstance(exc, GatewayError):
        record.status, record.ending = exc.status, type(exc).__name__
    elif isinstance(exc, asyncio.CancelledError):
        if record.ending is None:  # before the relay: still queued, or waiting for the head
            record.ending = svc.cancel_reason()
    elif isinstance(exc, Exception):  # a bug: the middleware answers 500 and logs it
        record.status, record.ending = 500, "internal_error"


async def _prioritised(svc: Services, request: Request, principal: Principal, route: Route) -> int:
    """The request's priority, once it may be served within its objective, if it gave one
    (``gateway.request.slo``)."""
    priority = _priority(svc, request, principal)
    slo_header = svc.settings.latency.slo_header
    slo = parse_slo(request.headers.get(slo_header)) if slo_header else None
    if slo is not None:
        await meet_slo(svc, route.serve, slo, priority)
    return priority


def _priority(svc: Services, request: Request, principal: Principal) -> int:
    """The request's priority: the header's, clamped to its tier's bounds, else its tier's."""
    header = svc.settings.limits.admission.priority_header
    return parse_priority(
        request.headers.get(header), principal.max_priority, default=principal.priority
    )


async def _wait_for_capacity(
    svc: Services, principal: Principal, priority: int
) -> AdmissionTicket | None:
    """Hold the request in the admission queue while every backend is saturated.

    A request let through takes its lease (``Router.pick``) before it next awaits.
    """
    admission = svc.admission
    if admission is None:
        return None
    started = time.monotonic()
    ticket = await admission.acquire(principal.id, priority, principal.max_wait)
    if ticket.queued:
        svc.metrics.queue_wait.observe(time.monotonic() - started)
    return ticket


async def _traced(call: Call, route: Route, doc: dict[str, Any]) -> StreamResponse:
    svc, record = call.svc, call.record
    tracer = svc.tracer
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
            _classify(svc, record, exc)  # before the span is annotated
            raise
        finally:
            annotate(span, record)


async def _serve(
    call: Call, route: Route, doc: dict[str, Any], span: Span | None
) -> StreamResponse:
    """Run the route's steps: the prefill (if any), then the step that answers the client."""
    call.svc.retry_budget.deposit()  # one request: its share of the extra attempts' budget
    if route.prefill is None:
        return await _answered(call, route.serve, span)
    svc, record = call.svc, call.record
    metrics = svc.metrics
    svc.router.check(route.serve)  # no decode backend: fail before any prefill
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
        return await attempts(call, step, span, answer)
    except StreamBroken as broken:
        try:
            return await resume(call, step, span, broken)
        except asyncio.CancelledError:  # the client left (or the gateway stops) meanwhile
            call.record.ending = call.svc.cancel_reason()
            raise


def route_endpoint(endpoint: Endpoint, svc: Services) -> Handler:
    """The request handler of one of ``gateway.request.endpoints``' JSON endpoints."""

    async def handler(request: Request) -> StreamResponse:
        return await forward(request, endpoint, svc)

    return handler
