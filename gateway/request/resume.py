"""Continuing a stream on other backends when its own breaks mid-way: the I/O around
``gateway.request.continuation``'s pure parts.

``resume`` runs after an attempt raised ``StreamBroken`` (its lease released and its backend
judged already): it decides whether the stream can be continued faithfully, and if so runs the
attempt loop (``gateway.request.attempt.attempts``) with its own bounds, each attempt asking one
backend for the rest of the answer (``_resume_attempt``) and relaying it into the client's
open response through a ``Stitch``. What cannot be continued ends as before: vLLM's error
event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from functools import partial

import structlog
from opentelemetry.trace import Span

from backends.errors import (
    BackendRefused,
    BackendStalled,
    EngineFailed,
    GatewayError,
    UpstreamError,
    UpstreamProtocolError,
)
from backends.upstream.client import json_or_none
from gateway.http import StreamResponse
from gateway.limits.tokens import UsageFilter
from gateway.request.attempt import attempts
from gateway.request.call import Answered, Call, StreamBroken, Try, error_kind
from gateway.request.continuation import StreamProgress
from gateway.request.record import Ending
from gateway.request.relay import EVENT_STREAM, Chunks, RelayResult, end_stream, relay_resumed
from gateway.request.retry import RETRYABLE_STATUS
from gateway.request.router import Step
from gateway.request.send import open_upstream

log = structlog.get_logger("gateway.request")


async def resume(call: Call, step: Step, span: Span | None, broken: StreamBroken) -> Answered:
    """Continue a broken stream on other backends, as many times as the settings allow.

    What cannot be continued faithfully (or finds no backend in time) ends as it did before
    continuations existed: vLLM's error event, then [DONE].
    """
    svc, record = call.svc, call.record
    settings, metrics = svc.settings.continuation, svc.metrics
    continuing = call.continuing
    assert continuing is not None
    dialect = call.endpoint.dialect
    resp, progress = broken.response, broken.progress
    failed_on = [broken.backend]
    retry = replace(svc.retry, max_attempts=settings.max_attempts, deadline=settings.deadline)
    while True:
        reason = _break_reason(broken.error)
        if progress.done or progress.finished is not None:  # only the stream's end was lost
            metrics.continuations.labels(reason, "complete").inc()
            await end_stream(resp, None, done=progress.done, dialect=dialect)
            return Answered(resp, Ending.COMPLETE)
        why = continuing.blocker(progress)
        if why is None and record.continuations >= settings.max_continuations:
            why = "limit"
        if why is None and not await svc.retry_budget.take("continuation"):
            why = "retry_budget"  # extra attempts are over their budget: ends as it broke
            record.budget_refused = "continuation"
        if why is not None:
            metrics.continuations.labels(reason, why).inc()
            log.warning(
                "stream_not_continued", backend=broken.backend, error=broken.error.message, why=why
            )
            await end_stream(resp, broken.error, dialect=dialect)
            return Answered(resp, Ending.UPSTREAM_ERROR)
        record.continuations += 1
        log.info(
            "stream_continuing",
            backend=broken.backend,
            error=broken.error.message,
            sent_events=progress.events,
            continuation=record.continuations,
        )
        attempt = partial(_resume_attempt, resp=resp, progress=progress)
        # Where the rest is asked for (a Messages stream: as the chat vLLM renders).
        asks = call if continuing.path is None else replace(call, path=continuing.path)
        try:
            done = await attempts(
                asks, step, span, attempt, retry=retry, since=time.monotonic(), exclude=failed_on
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
            await end_stream(resp, broken.error, dialect=dialect)
            return Answered(resp, Ending.UPSTREAM_ERROR)
        metrics.continuations.labels(reason, "continued").inc()
        return done


def _break_reason(error: UpstreamError) -> str:
    """The ``reason`` label of a broken stream: ``error_kind``'s names, and two of its own."""
    if isinstance(error, BackendStalled):
        return "stalled"
    if isinstance(error, EngineFailed):
        return "engine_error"
    kind = error_kind(error)
    return kind if kind in ("timeout", "protocol") else "unreachable"


async def _sent_tokens(t: Try, progress: StreamProgress) -> int:
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
    svc = call.svc
    client = svc.upstream
    assert call.continuing is not None
    model = call.continuing.doc.get("model")
    body = {"model": model, "prompt": text, "add_special_tokens": False}
    raw = json.dumps(body).encode()
    try:
        async with asyncio.timeout(svc.settings.continuation.tokenize_timeout):
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


async def _resume_attempt(t: Try, *, resp: StreamResponse, progress: StreamProgress) -> Answered:
    """One backend's try at the rest of a broken stream, into the client's open ``resp``."""
    call = t.call
    svc, record = call.svc, call.record
    client = svc.upstream
    assert call.continuing is not None
    sent = await _sent_tokens(t, progress)
    body, stitch = call.continuing.rest(progress, sent)
    upstream = await open_upstream(t, json.dumps(body, separators=(",", ":")).encode())
    complete = False
    try:
        if upstream.status != 200 or upstream.content_type != EVENT_STREAM:
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
        record.ended_at = time.monotonic()
        return Answered(resp, Ending.COMPLETE)
    except asyncio.CancelledError:  # the client left: closing the upstream aborts it
        record.abort_reason = svc.cancel_reason()
        raise
    finally:
        client.finish(upstream, complete=complete)
