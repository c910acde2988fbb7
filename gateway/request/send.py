"""Sending one attempt's request to its backend: the one way every kind of attempt sends."""

from __future__ import annotations

import asyncio
import time

from multidict import CIMultiDict
from opentelemetry.trace import set_span_in_context

from backends.upstream.client import Interrupt, RequestBody, Upstream
from gateway.observe.tracing import attempt_span, inject
from gateway.request.call import Try, rescue_now
from gateway.request.priority import VLLM_PRIORITY, with_priority
from gateway.request.waits import first_token_late, marked_down


async def open_upstream(t: Try, body: RequestBody) -> Upstream:
    """Send ``body`` on ``t``'s backend and return once its answer's head is in.

    Until something reaches the client, and if another backend could take the request, the
    lease's down signal interrupts the wait (``BackendDown``): a backend marked down may still
    answer, so with nowhere else to go the request keeps waiting. A cancellation here (the
    client left) counts as an upstream abort: closing the half-open request is what tells the
    backend to stop.
    """
    call = t.call
    svc, record = call.svc, call.record
    headers = call.headers
    if call.engine_priority is not None and t.lease.backend.spec.scheduling == "priority":
        if call.endpoint.priority == "header":
            headers = CIMultiDict(headers)
            headers[VLLM_PRIORITY] = str(call.engine_priority)
        elif isinstance(body, bytes):
            body = with_priority(body, call.engine_priority)
    if t.parent is not None:
        t.span = attempt_span(svc.tracer, t.parent, t.lease.backend.id, t.n)
        t.span.set_attribute("llm_gateway.step", t.step.name)
        headers = CIMultiDict(headers)
        inject(headers, set_span_in_context(t.span))
    interrupt = None
    if t.may_retry or t.race is not None:  # another backend could take the request instead
        backend = t.lease.backend.id
        interrupt = Interrupt() if t.race is None else t.race.join(backend)
        if t.may_retry:
            t.lease.on_down(lambda: interrupt.end(marked_down(backend)))
        within = t.first_token_within
        if within is not None:

            def late(lag: float) -> None:
                if rescue_now(t, lag):
                    interrupt.end(first_token_late(backend, within))

            interrupt.after(within, late)
        t.interrupt = interrupt
    t.tally.sent_at = time.monotonic()
    try:
        upstream = await svc.upstream.open(
            t.lease.backend.spec, call.path, body, headers, interrupt=interrupt
        )
    except asyncio.CancelledError:
        record.abort_reason = svc.cancel_reason()
        raise
    record.sent = True
    t.tally.status = upstream.status
    return upstream
