"""Moves a backend's answer to the client. Knows nothing about routing.

A stream is relayed read by read: every chunk the backend sends is written to the client as it
arrives, untouched. The relay watches only for the first token (to time it) and reports how
the answer ended. It reads the first chunk before sending anything to the client, so a backend
that fails before its first byte raises, and the caller may still try another backend.

After the first chunk, the rest of the stream takes the fast path when it can: a ``Splice``
fed by a tap on the upstream body (``backends.upstream.h1.UpstreamResponse.tap``) writes each
read to the client's transport from the upstream read callback, so a token costs no task
wake-up at all.
The slow path (``readany`` / ``write`` in the handler task) remains for what cannot be tapped.
The splice writes to the client's transport under the gateway's own server's flow control
(``gateway.http.StreamResponse``: ``writing_paused``, ``drain``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from multidict import CIMultiDict

from backends.errors import EngineFailed, UpstreamError
from backends.state import BackendSpec
from backends.upstream.client import CLIENT_ERRORS, Transport, Upstream, translate
from backends.upstream.idle import IdleWatch
from gateway.http import Request, Response, StreamResponse
from gateway.limits.tokens import UsageFilter
from gateway.request.api import Stitcher
from gateway.request.continuation import Keep
from gateway.request.dialects import OPENAI, Dialect
from gateway.request.record import Ending
from gateway.request.sse import FirstTokenWatch
from gateway.request.waits import outrun

EVENT_STREAM: Final = "text/event-stream"  # the content type of a stream to relay


@dataclass(slots=True)
class RelayResult:
    ending: Ending
    first_token_at: float | None = None
    error: UpstreamError | None = None
    events: int = 0  # SSE "data:" events relayed
    on_first: Callable[[], None] | None = None  # called once, at the first token
    dialect: Dialect = OPENAI  # the error event's shape


# An alias's answer: the served model name's JSON field, and the alias's
# (``gateway.request.rollout``).
Rename = tuple[bytes, bytes]


def renamed(data: bytes, rename: Rename | None) -> bytes:
    return data if rename is None else data.replace(*rename)


def partial_tail(data: bytes, field: bytes) -> int:
    """How many bytes at the end of ``data`` begin ``field`` without completing it.

    A read can end inside an event, so ``"model":"served"`` may arrive split over two reads;
    those bytes wait for the next read. Only an unfinished event is held back: it could not be
    parsed before the rest of it arrived anyway.
    """
    if data.endswith(b"\n\n"):  # the usual read: whole events
        return 0
    start = max(len(data) - len(field) + 1, 0)
    quote = field[:1]
    at = data.find(quote, start)
    while at != -1:
        if field.startswith(data[at:]):
            return len(data) - at
        at = data.find(quote, at + 1)
    return 0


class Chunks:
    """What both stream paths do with each upstream read, in one place.

    Counts it for the idle watchdog and the event tally, times the first token, keeps what
    a continuation would need (``keep``: whole events only, stopping at an engine's error
    event, which sets ``cut``), drops a usage chunk the client didn't ask for, and renames
    the model for an alias. ``take`` returns the bytes to send (maybe none).
    """

    __slots__ = (
        "_first_token",
        "_held",
        "_now",
        "_rename",
        "_result",
        "_usage",
        "_watch",
        "keep",
    )

    def __init__(
        self,
        watch: IdleWatch,
        result: RelayResult,
        usage: UsageFilter,
        now: Callable[[], float],
        rename: Rename | None,
        *,
        keep: Keep[Any] | None = None,
    ) -> None:
        self._watch = watch
        self._result = result
        self._first_token = FirstTokenWatch()
        self._usage = usage
        self._now = now
        self._rename = rename
        self._held = b""  # the start of a model field a read ended in (renaming only)
        self.keep = keep

    @property
    def cut(self) -> str | None:
        """The engine's failure message, once an event reported one (nothing more is sent)."""
        return None if self.keep is None else self.keep.cut

    def take(self, data: bytes) -> bytes:
        self._watch.activity += 1
        result = self._result
        events = data.count(b"data:")
        result.events += events
        if not self._first_token.seen and self._first_token.feed(data):
            result.first_token_at = self._now()
            if result.on_first is not None:
                result.on_first()
        if self.keep is not None:
            data = self.keep.take(data, events)
        out = self._usage.feed(data)  # the same bytes, less a usage chunk the client didn't want
        if out and self._rename is not None:
            old, new = self._rename
            if self._held:
                out, self._held = self._held + out, b""
            out = out.replace(old, new)
            if held := partial_tail(out, old):
                out, self._held = out[:-held], out[-held:]
        return out

    def hold(self, held: bool) -> None:
        """The client is holding the stream back (or no longer): the idle and stall watchdog
        does not count the time against the backend."""
        self._watch.held = held

    def rest(self) -> bytes:
        """What the usage filter (and the renaming) still holds at the end of the stream."""
        held, self._held = self._held, b""
        return renamed(held + self._usage.flush(), self._rename)


class _Resumable(Protocol):
    def resume(self) -> None: ...


class _WriteFlow(Protocol):
    @property
    def writing_paused(self) -> bool: ...


class Splice:
    """A tap's sink that writes each upstream read to a chunked client response.

    ``run()`` returns when the stream has ended; ``result.ending`` says how.

    When the client reads slower than the backend writes, the client transport's buffer
    passes its high-water mark, the splice asks the tap to stop reading the backend, and
    ``run()`` resumes it once the client has drained: memory stays bounded.
    """

    def __init__(
        self,
        *,
        client: asyncio.Transport,
        client_flow: _WriteFlow,
        backend: BackendSpec,
        result: RelayResult,
        chunks: Chunks,
    ) -> None:
        self._client = client
        self._client_flow = client_flow
        self._backend = backend
        self._result = result
        self._chunks = chunks
        self._paused = False
        self._over = False
        self._wake: asyncio.Future[None] | None = None

    # StreamSink: called from the upstream transport's read callback.

    def on_data(self, data: bytes) -> bool:
        if self._over:
            return False
        chunks = self._chunks
        out = chunks.take(data)
        if out:
            client = self._client
            if client.is_closing():
                self._end(Ending.CLIENT_DISCONNECT)
                return True
            client.write(b"%x\r\n%b\r\n" % (len(out), out))  # one HTTP chunk
        if chunks.keep is not None and chunks.cut is not None:
            self.on_error(EngineFailed(f"backend {self._backend.id}: {chunks.cut}"))
            return True
        if out and self._client_flow.writing_paused:
            self._paused = True
            chunks.hold(True)
            self._wakeup()
            return True
        return False

    def on_end(self) -> None:
        self._end(Ending.COMPLETE)

    def on_error(self, exc: BaseException) -> None:
        if not self._over:
            self._result.error = (
                exc if isinstance(exc, UpstreamError) else translate(exc, self._backend)
            )
            self._end(Ending.UPSTREAM_ERROR)

    # The handler task's side.

    async def run(self, tap: _Resumable, drain: Callable[[], Awaitable[None]]) -> None:
        """Return when the stream has ended (``result.ending`` says how)."""
        loop = asyncio.get_running_loop()
        while not self._over:
            if self._paused:
                try:
                    await drain()
                except ConnectionError:
                    self._end(Ending.CLIENT_DISCONNECT)
                    break
                self._paused = False
                self._chunks.hold(False)
                tap.resume()  # may deliver, pause again or end before it returns
                continue
            self._wake = loop.create_future()
            try:
                await self._wake
            finally:
                self._wake = None

    def _end(self, ending: Ending) -> None:
        if not self._over:
            self._over = True
            self._result.ending = ending
            self._wakeup()

    def _wakeup(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)


async def relay_stream(
    request: Request,
    upstream: Upstream,
    headers: CIMultiDict[str],
    now: Callable[[], float],
    *,
    usage: UsageFilter,
    result: RelayResult,
    rename: Rename | None = None,
    keep: Keep[Any] | None = None,
) -> StreamResponse:
    """Relay an event stream chunk by chunk, until either side ends it.

    ``result`` is filled in as the stream goes (first token, events), so it tells what was
    relayed even when the handler is cancelled mid-stream; ``result.ending`` says how it ended.
    Raises ``UpstreamError`` if the backend fails before its first chunk (nothing sent yet).
    With ``keep`` (the stream may be continued elsewhere), a stream that breaks is left open:
    the caller continues it or ends it (``end_stream``).
    """
    content = upstream.content
    try:
        chunk = await content.readany()
    except CLIENT_ERRORS as exc:
        raise translate(exc, upstream.backend) from exc
    if upstream.interrupt is not None and not upstream.interrupt.take():
        raise outrun(upstream.backend.id)  # a rival attempt (a hedge) took the client first
    # From the first write on, the stream is the client's.
    resp = StreamResponse(status=upstream.status, headers=headers)  # head with 1st chunk
    result.ending = Ending.COMPLETE
    chunks = Chunks(upstream.watch, result, usage, now, rename, keep=keep)
    fast_path_tried = False
    try:
        await resp.prepare(request)
        while chunk:
            out = chunks.take(chunk)
            if out or not fast_path_tried:
                chunks.hold(True)  # a write waits while the client's buffer is full
                await resp.write(out)  # the first write also sends the head, with it
                chunks.hold(False)
            if chunks.cut is not None:
                result.ending = Ending.UPSTREAM_ERROR
                result.error = EngineFailed(f"backend {upstream.backend.id}: {chunks.cut}")
                break
            if not fast_path_tried:
                fast_path_tried = True
                if await _spliced(resp, upstream, result, chunks):
                    break
            try:
                chunk = await content.readany()
            except CLIENT_ERRORS as exc:
                result.ending = Ending.UPSTREAM_ERROR
                result.error = translate(exc, upstream.backend)
                break
        if result.ending is Ending.UPSTREAM_ERROR and keep is not None:
            return resp  # the caller continues it elsewhere, or ends it
        await _close(resp, chunks, result)
    except ConnectionResetError:  # the client went away between two writes
        result.ending = Ending.CLIENT_DISCONNECT
    except asyncio.CancelledError:  # the client went away (the server cancels its handler)
        result.ending = Ending.CLIENT_DISCONNECT
        raise
    return resp


async def _close(resp: StreamResponse, chunks: Chunks, result: RelayResult) -> None:
    if result.ending is Ending.UPSTREAM_ERROR:
        assert result.error is not None
        await resp.write(chunks.rest() + result.dialect.error_event(result.error))
    if result.ending is not Ending.CLIENT_DISCONNECT:
        await resp.write_eof(chunks.rest())


async def end_stream(
    resp: StreamResponse,
    error: UpstreamError | None,
    *,
    done: bool = False,
    dialect: Dialect = OPENAI,
) -> None:
    """End a broken stream that was not continued: vLLM's error event, then [DONE]; or,
    with no ``error``, only the [DONE] it lacked (``done``: not even that; a Messages
    stream's ``message_stop``)."""
    try:
        if error is not None:
            await resp.write(dialect.error_event(error))
        elif not done:
            await resp.write(dialect.stream_end())
        await resp.write_eof()
    except ConnectionResetError:  # the client went away meanwhile
        pass


async def relay_resumed(
    resp: StreamResponse,
    upstream: Upstream,
    stitch: Stitcher,
    chunks: Chunks,
) -> UpstreamError | None:
    """Relay a continuation into the client's open stream ``resp``, through ``stitch``.

    Returns None once the stream has ended (and is closed), or the error that broke it after
    some of this continuation reached the client. Raises ``UpstreamError`` if it broke before
    (so another backend may be tried at no cost to the client).
    """
    content = upstream.content
    wrote = False
    while True:
        try:
            chunk = await content.readany()
        except CLIENT_ERRORS as exc:
            error = translate(exc, upstream.backend)
            if not wrote:
                raise error from exc
            return error
        if not chunk:
            break
        out = chunks.take(stitch.feed(chunk))
        if out:
            if not wrote and upstream.interrupt is not None:
                upstream.interrupt.take()  # from now on this part is the client's too (no race)
            chunks.hold(True)  # a write waits while the client's buffer is full
            await resp.write(out)
            chunks.hold(False)
            wrote = True
        if stitch.cut is not None:
            failed = EngineFailed(f"backend {upstream.backend.id}: {stitch.cut}")
            if not wrote:
                raise failed
            return failed
    await resp.write_eof(chunks.rest())
    return None


async def _spliced(
    resp: StreamResponse, upstream: Upstream, result: RelayResult, chunks: Chunks
) -> bool:
    """Relay the rest of the stream on the fast path; False (nothing done) if it can't."""
    client, flow = resp.transport, resp.flow
    if not resp.chunked or client is None or flow is None or client.is_closing():
        return False
    splice = Splice(
        client=client,
        client_flow=flow,
        backend=upstream.backend,
        result=result,
        chunks=chunks,
    )
    t = upstream.response.tap(splice) if upstream.response is not None else None
    if t is None:
        return False
    resp.flush_head()  # the splice writes chunks straight to the transport
    try:
        await splice.run(t, resp.drain)
    finally:
        t.close()
    return True


async def relay_body(
    upstream: Upstream,
    headers: CIMultiDict[str],
    client: Transport,
    rename: Rename | None = None,
    read: bytes | None = None,
) -> Response:
    """Read a whole (non-stream) answer (``read``: already read), then send it: errors
    before any byte stay mappable."""
    body = renamed(await client.read_body(upstream) if read is None else read, rename)
    return Response(status=upstream.status, body=body, headers=headers)
