"""One client connection: httptools (llhttp) parses, one handler task at a time answers.

Requests are parsed as they come, queued (up to ``max_pipelined`` ahead of the one being
answered, then the socket is no longer read) and answered strictly in order. A request's
handler task starts once its head is complete; its body streams into ``request.content``. The
connection stays open after an answer unless the client asked otherwise (HTTP/1.0 without
``keep-alive``, ``Connection: close``), the answer went out before its request's body had all
come (the rest is never read as a request), or the server is stopping.

A request the server will not take (bad framing, a head too large or too slow, an unsupported
``Expect``) is answered by the connection itself, in its turn, with ``Connection: close``; its
handler is never called. Each is one ``http_refused`` log line, sampled under a flood.

One timer per connection, re-armed lazily: it watches either the idle keep-alive time or the
head of a request that spans several reads (a head that comes in one read arms nothing). A
client that goes away cancels the handler task, whatever it awaits.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from typing import Final, cast

import httptools
import structlog
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.http.message import Body, Request, split_target
from gateway.http.refusal import Refused, parser_refusal
from gateway.http.shared import Shared

log = structlog.get_logger("gateway.http")

_VERSIONS: Final = {"1.1": (1, 1), "1.0": (1, 0)}
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"

# Why the socket is not being read (bits): a body's buffer is full; requests wait their turn.
_BODY_FULL: Final = 1
_PIPELINE_FULL: Final = 2

# What the connection's timer watches.
_NOTHING: Final = 0
_IDLE: Final = 1
_HEAD: Final = 2
_CLOSING: Final = 3  # closed with unsent bytes: cut off if the client never takes them

_EARLY: Final = 0.001  # a timer may fire this early (the loop's clock resolution)


class _Stop(Exception):
    """Raised from a parser callback: read no further request on this connection."""


class Connection(asyncio.Protocol):
    """An ``asyncio.Protocol`` for one client connection (see the module's docstring)."""

    __slots__ = (
        "_close_after",
        "_current",
        "_deadline",
        "_deadline_kind",
        "_done",
        "_drainers",
        "_finished_in_feed",
        "_head_bytes",
        "_head_fields",
        "_head_sent",
        "_headers",
        "_in_head",
        "_loop",
        "_lost",
        "_no_more",
        "_parser",
        "_parsing",
        "_paused",
        "_queue",
        "_refusal",
        "_refusal_path",
        "_refused",
        "_send_expired",
        "_shared",
        "_task",
        "_timer",
        "_url",
        "config",
        "peer",
        "remote",
        "transport",
        "writing_paused",
    )

    def __init__(self, shared: Shared[Connection]) -> None:
        self._shared = shared
        self.config = shared.config
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None
        self.remote: str | None = None
        self._lost = False
        # the head being parsed
        self._in_head = False
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._head_fields = 0  # bytes of the head's complete fields
        self._head_bytes = 0  # bytes read while the head is incomplete
        self._finished_in_feed = False
        self._refused: Refused | None = None  # raised from a callback
        # the requests
        self._parsing: Request | None = None  # its body is still coming
        self._queue: deque[Request] = deque()  # parsed, waiting their turn
        self._current: Request | None = None  # being answered
        self._task: asyncio.Task[None] | None = None
        self._head_sent = False  # of the current answer
        self._done = False  # the current answer is whole
        self._close_after = False  # the current answer said Connection: close
        self._no_more = False  # no further request is read
        self._refusal: Refused | None = None  # answered after the queue, then closed
        self._refusal_path: str | None = None
        # flow control
        self._paused = 0
        self.writing_paused = False
        self._send_expired = False
        self._drainers: list[asyncio.Future[None]] = []
        # the one timer
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._deadline_kind = _NOTHING

    def __repr__(self) -> str:
        return f"<Connection {self.peer}>"

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.remote = str(peer[0])
            self.peer = f"{peer[0]}:{peer[1]}"
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._shared.connections.add(self)
        self._set_deadline(_IDLE, self._loop.time() + self.config.keepalive_timeout)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = True
        self.transport = None
        self._deadline_kind = _NOTHING
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        gone = ConnectionResetError("the client closed the connection")
        if self._parsing is not None:
            self._parsing.content.set_exception(gone)
        self._queue.clear()
        if self._task is not None:
            self._task.cancel()  # how a client that leaves cancels its upstream request
        self._wake_drainers()
        self._shared.lost(self)

    def eof_received(self) -> bool | None:
        return None  # a client that stops sending has gone: close

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._wake_drainers()

    def data_received(self, data: bytes) -> None:
        if self._no_more and self._parsing is None:
            return  # after a refusal, a close or while stopping: nothing more is a request
        self._finished_in_feed = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._no_more = True  # answered as any request, then closed: not ours to switch
        except httptools.HttpParserError as exc:
            if self._refused is not None or not self._no_more or self._parsing is not None:
                self._refuse(self._refused or parser_refusal(exc))
            # else: bytes after the last request this connection reads (_Stop, or llhttp's
            # own "data after Connection: close"): ignored
        else:
            if self._in_head:
                if not self._finished_in_feed:  # all of data is the head's
                    self._head_bytes += len(data)
                limit = 4 * self.config.max_header_bytes
                if self._head_bytes > limit:
                    self._refuse(Refused(431, f"Request head larger than {limit} bytes"))
                elif self._deadline_kind != _HEAD:
                    self._set_deadline(_HEAD, self._loop.time() + self.config.header_timeout)
        if self._task is None and self._queue and not self._lost:
            self._start_next()

    # -- httptools' callbacks (inside data_received) -----------------------------------

    def on_message_begin(self) -> None:
        if self._no_more:
            raise _Stop
        self._in_head = True
        self._url = b""
        self._headers = []
        self._head_fields = 0
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url = self._url + url if self._url else url
        if len(self._url) > self.config.max_header_bytes:
            raise self._limit(
                414, f"Request target longer than {self.config.max_header_bytes} bytes"
            )

    def on_header(self, name: bytes, value: bytes) -> None:
        config = self.config
        size = len(name) + len(value)
        if size > config.max_header_bytes:
            raise self._limit(
                431, f"Request header field longer than {config.max_header_bytes} bytes"
            )
        self._head_fields += size + 4
        if self._head_fields + len(self._url) > 4 * config.max_header_bytes:
            raise self._limit(431, f"Request head larger than {4 * config.max_header_bytes} bytes")
        headers = self._headers
        if len(headers) >= config.max_headers:
            raise self._limit(431, f"More than {config.max_headers} request header fields")
        headers.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        parser = self._parser
        self._in_head = False
        if self._deadline_kind == _HEAD:
            self._deadline_kind = _NOTHING
        named = parser.get_http_version()
        version = _VERSIONS.get(named)
        if version is None:
            raise self._limit(505, f"HTTP/{named} is not supported")
        headers = CIMultiDictProxy(CIMultiDict(self._headers))
        expect = headers.get("Expect")
        expect_continue = False
        if expect is not None:
            if expect.lower() != "100-continue":
                raise self._limit(417, f"Unsupported expectation: {expect[:64]}")
            expect_continue = version == (1, 1)  # HTTP/1.0 clients do not wait for it
        try:
            request = Request(
                method=parser.get_method().decode("ascii"),
                target=self._url.decode("utf-8", "surrogateescape"),
                headers=headers,
                version=version,
                content=Body(self, expect_continue=expect_continue),
                channel=self,
                remote=self.remote,
                max_body_bytes=self.config.max_body_bytes,
                keep_alive=parser.should_keep_alive(),
            )
        except ValueError:
            raise self._limit(400, "Invalid request target") from None
        self._parsing = request
        self._queue.append(request)
        if len(self._queue) > self.config.max_pipelined:
            self._pause(_PIPELINE_FULL)

    def on_body(self, body: bytes) -> None:
        if self._parsing is not None:
            self._parsing.content.feed(body)

    def on_message_complete(self) -> None:
        self._finished_in_feed = True
        request = self._parsing
        if request is None:
            return
        self._parsing = None
        request.content.feed_eof()
        if not request.keep_alive:
            self._no_more = True

    def _limit(self, status: int, reason: str) -> Refused:
        self._refused = refused = Refused(status, reason)
        return refused

    # -- answering ---------------------------------------------------------------------

    def _start_next(self) -> None:
        request = self._queue.popleft()
        if self._paused & _PIPELINE_FULL and len(self._queue) <= self.config.max_pipelined:
            self._resume(_PIPELINE_FULL)
        self._current = request
        self._head_sent = self._done = self._close_after = False
        if self._deadline_kind == _IDLE:
            self._deadline_kind = _NOTHING
        self._task = self._loop.create_task(self._serve(request))

    async def _serve(self, request: Request) -> None:
        try:
            response = await self._shared.handler(request)
            response._finish(request)
        except Exception:
            self._failed(request)
        finally:
            self._end_request(request)

    def _failed(self, request: Request) -> None:
        """The handler raised (a bug): 500 if nothing was sent yet, else cut the answer."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return  # the client left (a write found it gone): nobody to tell
        log.exception("unhandled_error", path=request.path)
        if self._done:  # after a whole answer: it stands, but the connection ends with it
            self._close_after = True
            return
        if self._head_sent:
            transport.abort()
            return
        message = "The gateway failed to handle this request."
        self._send_error(500, message, request.path)
        self._done = self._close_after = True

    def _end_request(self, request: Request) -> None:
        self._task = None
        self._current = None
        request.content.release()
        transport = self.transport
        if transport is None:
            return
        if not self._done:
            if self._refusal is not None and not self._head_sent:
                self._send_refusal()  # the body broke its framing: the handler was cancelled
            else:
                transport.abort()  # an answer cut short (cancelled): it cannot be completed
            return
        if self._close_after:
            self._close()
        elif self._queue:
            self._start_next()
        elif self._refusal is not None:
            self._send_refusal()
        elif self._no_more:
            self._close()
        else:
            if self._paused & _PIPELINE_FULL:
                self._resume(_PIPELINE_FULL)
            if not self._in_head:
                self._set_deadline(_IDLE, self._loop.time() + self.config.keepalive_timeout)

    # -- the response's side (gateway.http.response.Writer) ----------------------------

    def seal_head(self, request: Request, head: bytes, *, close: bool, date: bool) -> bytes:
        if (
            close
            or not request.keep_alive
            or not request.content.is_eof()  # the rest of the body will not be read
            or (self._no_more and not self._queue and self._refusal is None)
        ):
            self._close_after = True
        shared = self._shared
        parts = [head]
        if date:
            parts.append(shared.date())
        if shared.server:
            parts.append(shared.server)
        if self._close_after:
            parts.append(b"Connection: close\r\n\r\n")
        elif request.version == (1, 0):
            parts.append(b"Connection: keep-alive\r\n\r\n")
        else:
            parts.append(b"\r\n")
        return b"".join(parts)

    def send(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client has gone")
        self._head_sent = True
        transport.write(data)

    def finished(self, request: Request) -> None:
        if request is self._current:
            self._done = True

    async def drain(self) -> None:
        if self._lost or self._send_expired:
            raise ConnectionResetError("the client has gone")
        if not self.writing_paused:
            return
        loop = self._loop
        waiter = loop.create_future()
        self._drainers.append(waiter)
        timer = loop.call_at(loop.time() + self.config.send_timeout, self._send_timed_out)
        try:
            await waiter
        finally:
            timer.cancel()
            if waiter in self._drainers:
                self._drainers.remove(waiter)
        if self._lost or self._send_expired:
            raise ConnectionResetError("the client has gone")

    def _send_timed_out(self) -> None:
        """The client read nothing for ``send_timeout``: it holds nothing any longer."""
        if not self.writing_paused or self.transport is None:
            return
        self._send_expired = True
        self._wake_drainers()  # the waiting handler sees ConnectionResetError first
        self.transport.abort()

    def _wake_drainers(self) -> None:
        for waiter in self._drainers:
            if not waiter.done():
                waiter.set_result(None)
        self._drainers.clear()

    # -- the body's side (gateway.http.message.Channel) --------------------------------

    def pause_body(self) -> None:
        self._pause(_BODY_FULL)

    def resume_body(self) -> None:
        self._resume(_BODY_FULL)

    def send_continue(self) -> None:
        transport = self.transport
        if transport is not None and not self._head_sent and not transport.is_closing():
            transport.write(_CONTINUE)

    def _pause(self, why: int) -> None:
        if not self._paused and self.transport is not None:
            self.transport.pause_reading()
        self._paused |= why

    def _resume(self, why: int) -> None:
        if not self._paused & why:
            return
        self._paused &= ~why
        if not self._paused and self.transport is not None:
            self.transport.resume_reading()

    # -- refusals ----------------------------------------------------------------------

    def _refuse(self, refused: Refused) -> None:
        """Refuse the request being parsed: in its turn, then close."""
        if self._refusal is not None or self._lost:
            return
        self._refusal = refused
        self._no_more = True
        self._in_head = False
        if self._deadline_kind == _HEAD:
            self._deadline_kind = _NOTHING
        bad, self._parsing = self._parsing, None
        if bad is not None:
            self._refusal_path = bad.path
            bad.content.set_exception(ConnectionResetError("the request body broke HTTP's framing"))
        elif self._url:
            try:
                self._refusal_path = split_target(self._url.decode("utf-8", "surrogateescape"))[0]
            except ValueError:
                self._refusal_path = None
        self._shared.log_refusal(refused, self.peer)
        if bad is not None:
            if bad is self._current:
                if self._task is not None:
                    self._task.cancel()  # its answer is the refusal (if it has sent none)
                return
            if self._queue and self._queue[-1] is bad:
                self._queue.pop()
        if self._task is None and not self._queue:
            self._send_refusal()

    def _send_refusal(self) -> None:
        refused = self._refusal
        assert refused is not None
        self._send_error(refused.status, refused.reason, self._refusal_path)

    def _send_error(self, status: int, message: str, path: str | None) -> None:
        """An answer of the server's own, then close."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(self._shared.error_answer(status, message, path))
        self._close()

    def _close(self) -> None:
        """Close once what was written has gone out; a client that never takes it is cut
        off after ``send_timeout``."""
        transport = self.transport
        if transport is None:
            return
        transport.close()
        if transport.get_write_buffer_size():
            self._set_deadline(_CLOSING, self._loop.time() + self.config.send_timeout)

    # -- the timer ---------------------------------------------------------------------

    def _set_deadline(self, kind: int, at: float) -> None:
        self._deadline_kind = kind
        self._deadline = at
        timer = self._timer
        if timer is None or timer.when() > at:
            if timer is not None:
                timer.cancel()
            self._timer = self._loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        kind = self._deadline_kind
        if kind == _NOTHING or self.transport is None:
            return
        now = self._loop.time()
        if now + _EARLY < self._deadline:  # moved on since the timer was set
            self._timer = self._loop.call_at(self._deadline, self._on_timer)
            return
        self._deadline_kind = _NOTHING
        if kind == _CLOSING:
            self.transport.abort()
        elif kind == _IDLE:
            idle = self._task is None and not self._queue and self._parsing is None
            if idle and not self._in_head:
                self._close()
        elif self._in_head:
            if self._paused or self._task is not None:
                # The socket is not read, or the request before it is still being answered
                # (pipelined): its head is not late yet.
                self._set_deadline(_HEAD, now + self.config.header_timeout)
            else:
                timeout = self.config.header_timeout
                self._refuse(Refused(408, f"Request head not received within {timeout:g}s"))

    # -- the server's side -------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop taking requests: close now if idle, else after the answers owed."""
        self._no_more = True
        if self.transport is not None and self._task is None and not self._queue:
            self._close()

    def abort(self) -> None:
        """Cut the connection now (the server's grace period is over)."""
        if self._task is not None:
            self._task.cancel()
        if self.transport is not None:
            self.transport.abort()

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The handler task running now, if any."""
        return self._task
