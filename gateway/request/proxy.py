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
from gateway.request.call import Answered, Call, StreamBroken
from gateway.request.disagg import decode_body, prefill_attempt, prefill_body
from gateway.request.endpoints import Endpoint
from gateway.request.form import Upload
from gateway.request.headers import REQUEST_ID, upstream_headers
from gateway.request.priority import engine_priority
from gateway.request.record import RequestOutcome, RequestRecord, finish
from gateway.request.resume import resume
from gateway.request.rollout import Choice
from gateway.request.router import Route, Step
from gateway.request.services import Services
from gateway.request.slo import meet_slo, parse_slo

_NO_USAGE_PLAN: Final = UsagePlan(inject=False, strip=False)


async def forward(request: Request, endpoint: Endpoint, svc: Services) -> StreamResponse:
    """Route one model-addressed JSON request (``endpoint``: what it is,
    ``gateway.request.endpoints``) to a backend serving its model, under the limits, and relay the
    answer; traced as one server span when tracing is on."""
    record = RequestRecord(
        request[REQUEST_ID_KEY], started=time.monotonic(), endpoint=endpoint.name
    )
    tracer = svc.tracer
    if tracer is None:
        return await _forward(request, endpoint, svc, record, None)
    with tracer.start_as_current_span(
        f"POST {request.path}",
        context=parent_context(request.headers),
        kind=SpanKind.SERVER,
        attributes={"http.request.id": record.request_id},
    ) as span:
        try:
            return await _forward(request, endpoint, svc, record, span)
        finally:
            annotate(span, record)  # once ``finish`` has said how it ended


async def _forward(
    request: Request, endpoint: Endpoint, svc: Services, record: RequestRecord, span: Span | None
) -> StreamResponse:
    limiter = svc.limiter
    grant: Grant | None = None
    upload: Upload | None = None
    outcome: RequestOutcome  # the answer's ending, or the exception that ended the request
    try:
        principal = limiter.authenticate(request.headers)
        record.key = principal.id
        settings = svc.settings
        raw, doc = await read_body(request, settings, endpoint=endpoint.name, form=endpoint.form)
        upload = raw if isinstance(raw, Upload) else None
        asked = record.model = request_model(doc)
        prepared = await endpoint.api.prepare(svc, doc, raw)
        pool = svc.router.pool
        route = partial(
            _routed,
            request,
            svc,
            asked,
            prepared.doc,
            raw=prepared.raw,
            endpoint=endpoint,
            pin=prepared.pin,
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
                response_id=prepared.response_id,
                engine_priority=engine_priority(routed.doc, request.headers, principal, priority),
            )
            answered = await _served(call, routed, principal.id, span)
        finally:
            if ticket is not None:
                ticket.release()
        outcome = answered.ending
        return answered.response
    except BaseException as exc:
        outcome = exc
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
            finish(svc, record, outcome)  # counted and logged even if cancelled while settling


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
    api = endpoint.api
    view = api.view(doc)
    tokens = None
    # precise_prefix: the prompt's blocks as the engine keys them. A salted request's blocks
    # are hashed with its salt: no other request's blocks are its prefix.
    if router.wants_tokens and "cache_salt" not in doc:
        tokens = await api.prompt_ids(svc, model, doc, view)
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
    api = endpoint.api
    continuing = api.continuing(doc) if svc.settings.continuation.enabled else None
    return Call(
        request,
        svc,
        request.path,
        body,
        upstream_headers(
            request.headers,
            api.upstream_id(request.headers, doc, record.request_id),
            own_priority=engine_priority is None,
        ),
        record,
        strip_usage=plan.strip,
        extra_headers=grant.headers,
        choice=routed.choice,
        continuing=continuing,
        endpoint=endpoint,
        response_id=response_id,
        streamed=endpoint.streams_tokens and doc.get("stream") is True,
        engine_priority=engine_priority if endpoint.priority is not None else None,
    )


async def _served(call: Call, routed: _Routed, owner: str, span: Span | None) -> Answered:
    """Serve ``call``, with what its API keeps meanwhile (``Api.serving``)."""
    kept = call.endpoint.api.serving(call.svc, call.headers[REQUEST_ID], owner, call.record)
    if kept is None:
        return await _serve(call, routed.route, routed.doc, span)
    with kept:
        return await _serve(call, routed.route, routed.doc, span)


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


async def _serve(call: Call, route: Route, doc: dict[str, Any], span: Span | None) -> Answered:
    """Run the route's steps: the prefill (if any), then the step that answers the client."""
    call.svc.retry_budget.deposit()  # one request: its share of the extra attempts' budget
    if route.prefill is None:
        return await _answered(call, route.serve, span)
    svc, record = call.svc, call.record
    metrics = svc.metrics
    svc.router.check(route.serve)  # no decode backend: fail before any prefill
    body = prefill_body(doc)
    prefilled = await attempts(call, route.prefill, span, lambda t: prefill_attempt(t, body))
    if isinstance(prefilled, Answered):  # the prefill refused the request (a 4xx)
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


async def _answered(call: Call, step: Step, span: Span | None) -> Answered:
    """The client's answer from ``step``'s backends; a stream that breaks on the way goes on
    from another backend when it can (``gateway.request.resume``)."""
    try:
        return await attempts(call, step, span, answer)
    except StreamBroken as broken:
        return await resume(call, step, span, broken)


def route_endpoint(endpoint: Endpoint, svc: Services) -> Handler:
    """The request handler of one of ``gateway.request.endpoints``' endpoints."""
    return partial(forward, endpoint=endpoint, svc=svc)
