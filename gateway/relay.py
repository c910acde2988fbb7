"""Moves a backend's answer to the client. Knows nothing about routing.

A stream is relayed read by read: every chunk the backend sends is written to the client as it
arrives, untouched. The relay watches only for the first token (to time it) and reports how
the answer ended. It reads the first chunk before sending anything to the client, so a backend
that fails before its first byte raises, and the caller may still try another backend.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDict

from backends.upstream import CLIENT_ERRORS, Upstream, UpstreamClient, translate
from gateway.errors import UpstreamError
from gateway.limits.tokens import UsageFilter
from gateway.sse import FirstTokenWatch


class Ending(enum.Enum):
    COMPLETE = "complete"
    UPSTREAM_ERROR = "upstream_error"
    CLIENT_DISCONNECT = "client_disconnect"


@dataclass(slots=True)
class RelayResult:
    ending: Ending
    first_token_at: float | None = None
    error: UpstreamError | None = None
    events: int = 0  # SSE "data:" events relayed


def stream_error_event(err: UpstreamError) -> bytes:
    """How a failure after the stream began reaches the client: as vLLM reports one."""
    body = json.dumps(err.envelope(), separators=(",", ":"))
    return b"data: " + body.encode() + b"\n\ndata: [DONE]\n\n"


async def relay_stream(
    request: web.Request,
    upstream: Upstream,
    headers: CIMultiDict[str],
    now: Callable[[], float],
    usage: UsageFilter,
) -> tuple[web.StreamResponse, RelayResult]:
    """Relay an event stream chunk by chunk, until either side ends it.

    Raises ``UpstreamError`` if the backend fails before its first chunk (nothing sent yet).
    """
    content = upstream.response.content
    idle = upstream.watch
    try:
        chunk = await content.readany()
    except CLIENT_ERRORS as exc:
        raise translate(exc, upstream.backend) from exc
    resp = web.StreamResponse(status=upstream.response.status, headers=headers)
    result = RelayResult(ending=Ending.COMPLETE)
    first_token = FirstTokenWatch()
    try:
        await resp.prepare(request)
        while chunk:
            idle.activity += 1
            result.events += chunk.count(b"data:")
            if not first_token.seen and first_token.feed(chunk):
                result.first_token_at = now()
            out = usage.feed(chunk)  # the same bytes, less a usage chunk the client didn't want
            if out:
                await resp.write(out)
            try:
                chunk = await content.readany()
            except CLIENT_ERRORS as exc:
                result.ending = Ending.UPSTREAM_ERROR
                result.error = translate(exc, upstream.backend)
                await resp.write(usage.flush() + stream_error_event(result.error))
                break
        await resp.write_eof(usage.flush())
    except ConnectionResetError:  # the client went away between two writes
        result.ending = Ending.CLIENT_DISCONNECT
    return resp, result


async def relay_body(
    upstream: Upstream, headers: CIMultiDict[str], client: UpstreamClient
) -> web.Response:
    """Read a whole (non-stream) answer, then send it: errors before any byte stay mappable."""
    body = await client.read_body(upstream)
    return web.Response(status=upstream.response.status, body=body, headers=headers)
