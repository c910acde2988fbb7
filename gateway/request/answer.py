"""One backend's try at the client's answer: send the request, judge the answer's head, relay
the answer (a whole body, or a stream event by event), and say how it ended.

An attempt raises ``UpstreamError`` only if nothing reached the client (the loop may try another
backend); a stream that breaks after the client got bytes raises ``StreamBroken`` when it may be
continued elsewhere (``gateway.request.resume``), else ends with an error event.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final, NoReturn

from backends.errors import BackendLacksEndpoint, BackendRefused, UpstreamTimeout
from backends.upstream.client import Upstream
from gateway.limits.tokens import UsageFilter, usage_from_body
from gateway.request.call import Answered, StreamBroken, Try
from gateway.request.continuation import Keep
from gateway.request.endpoints import is_route_missing
from gateway.request.headers import downstream_headers
from gateway.request.record import Ending
from gateway.request.relay import EVENT_STREAM, RelayResult, relay_body, relay_stream
from gateway.request.retry import RETRYABLE_STATUS
from gateway.request.send import open_upstream
from gateway.request.waits import outrun

_BUSY: Final = frozenset({429, 503})  # answers that tell the client when to come back


async def answer(t: Try) -> Answered:
    """One backend's try at the client's answer: relay it, or raise if nothing was sent."""
    call = t.call
    svc = call.svc
    client = svc.upstream
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
        dialect = call.endpoint.dialect
        if status >= 400 and dialect.reshapes_errors:  # its clients parse that
            if read is None:
                read = await client.read_body(upstream)
                complete = True
            read = dialect.reshaped(status, read)
        call.record.status = status
        if call.response_id is not None and status == 200:  # follow-ups must come back here
            await svc.response_homes.remember(call.response_id, t.lease.backend.id)
        answered, done = await _relay(t, upstream, read)
        complete = complete or done
        call.record.ended_at = time.monotonic()
        return answered
    except asyncio.CancelledError:  # the client left: closing the upstream aborts it
        call.record.abort_reason = svc.cancel_reason()
        raise
    finally:
        client.finish(upstream, complete=complete)


async def _relay(t: Try, upstream: Upstream, read: bytes | None = None) -> tuple[Answered, bool]:
    """Relay the answer (``read``: its body, if already read); return it, and whether the
    upstream response completed.

    Raises ``UpstreamError`` only if nothing reached the client; an error after that ends
    the stream with an error event and is kept in ``t.stream_error``.
    """
    call, tally = t.call, t.tally
    svc, record = call.svc, call.record
    headers = downstream_headers(upstream.headers, record.request_id)
    if upstream.status in _BUSY and "Retry-After" not in headers:
        headers["Retry-After"] = str(svc.settings.retry_after_seconds)
    if call.extra_headers:
        headers.update(call.extra_headers)
    rename = call.choice.rename if call.choice is not None else None
    if read is not None or upstream.content_type != EVENT_STREAM:
        if t.race is not None and t.interrupt is not None and not t.interrupt.take():
            raise outrun(upstream.backend.id)  # its rival took the client first
        whole = await relay_body(upstream, headers, svc.upstream, rename, read)
        if isinstance(whole.body, bytes):
            record.usage = usage_from_body(whole.body)
        tally.answered = True
        tally.tokens = record.usage.completion_tokens if record.usage else None
        return Answered(whole, Ending.COMPLETE), True
    usage = UsageFilter(strip=call.strip_usage)
    result = RelayResult(
        ending=Ending.UPSTREAM_ERROR,
        on_first=t.expected.pending.done if t.expected is not None else None,
        dialect=call.endpoint.dialect,
    )
    keep = None
    if call.continuing is not None:
        keep = Keep(call.continuing.progress(), svc.settings.continuation.compact_bytes)
    try:
        resp = await relay_stream(
            call.request,
            upstream,
            headers,
            time.monotonic,
            usage=usage,
            result=result,
            rename=rename,
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
    answered = Answered(resp, result.ending)
    if result.ending is Ending.UPSTREAM_ERROR:
        tally.error = "stream"
        t.stream_error = result.error
        record.abort_reason = "timeout" if isinstance(result.error, UpstreamTimeout) else "error"
        if keep is not None:
            assert result.error is not None
            raise StreamBroken(resp, result.error, t.lease.backend.id, keep.progress())
        return answered, False
    if result.ending is Ending.CLIENT_DISCONNECT:
        record.abort_reason = svc.cancel_reason()
        return answered, False
    tally.answered = True
    return answered, True


def _lacks(t: Try) -> NoReturn:
    """The backend has no route for the endpoint: remember it, and try another."""
    call, backend = t.call, t.lease.backend.id
    endpoint = call.endpoint.name
    call.svc.router.pool.record_lacks(backend, endpoint)
    raise BackendLacksEndpoint(
        f"No backend serving `{call.record.model}` offers the {endpoint} endpoint "
        f"({backend} answered that it has no {call.path}).",
        param="model",
    )
