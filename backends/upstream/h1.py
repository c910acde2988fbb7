"""The gateway's own HTTP/1.1 client for its backends: keep-alive connections, httptools' parser.

aiohttp's client did the job, but per request it cost the gateway more CPU than all of its own
routing (a ``ClientRequest``, a ``ClientResponse``, a connector lease, URL objects, a
``StreamReader`` per body), and its token streams could only be read fast through a tap on its
internals. This client does only what the gateway asks of a backend: send one request on a
pooled connection, hand back its status and headers, then either buffer the body for
``readany``/``read`` or give each socket read's decoded body straight to a sink (``tap``), from
the transport's read callback, with no task woken per token.

Framing is httptools' (llhttp, Node's parser): chunked and length-delimited bodies, keep-alive
decided by the response. A body without either ends when the connection closes. Failures are
``Broken`` subclasses (``backends.upstream.client.translate`` names them for the client): the
connection closed before the head (``Disconnected``) or before the end of the body
(``CutShort``), the response broke HTTP's framing (``BadFraming``), the connection could not
be made (``ConnectFailed``, ``ConnectTimeout``).

Flow control both ways: a request body larger than the socket takes is written as the
transport drains; a body nobody reads stops the socket being read past ``HIGH_WATER`` bytes,
as does a sink that says it is full (``StreamSink.on_data`` returning True) until ``resume``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Final, Protocol, cast
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

HIGH_WATER: Final = 1 << 16  # bytes of unread body before the socket is no longer read

# Set by the client from the request itself; a caller's own would contradict it.
_OWN_HEADERS: Final = frozenset({"host", "content-length", "transfer-encoding", "connection"})


class Broken(Exception):
    """An exchange with a backend that ended before its answer did."""


class Disconnected(Broken):
    """The connection closed before the response's head came."""


class CutShort(Broken):
    """The connection closed before the end of the response's body."""


class BadFraming(Broken):
    """The response broke HTTP's framing (a bad status line, header or chunk size)."""


class ConnectFailed(Broken):
    """The connection could not be made (the message says why)."""


class ConnectTimeout(Broken):
    """The connection was not made within the connect timeout."""


class StreamSink(Protocol):
    def on_data(self, data: bytes) -> bool:
        """One socket read's decoded body; return True to stop reading until ``resume``."""

    def on_end(self) -> None:
        """The body is complete."""

    def on_error(self, exc: BaseException) -> None:
        """The body cannot complete (connection lost, bad framing, idle timeout...)."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a backend's URL points: the pool's key, and what each request starts with."""

    host: str
    port: int
    tls: bool
    host_header: str
    base_path: str  # the URL's own path, before the request's


@functools.lru_cache(maxsize=1024)
def origin(url: str) -> Origin:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    netloc = parts.netloc.rpartition("@")[2]
    return Origin(
        parts.hostname,
        parts.port or (443 if tls else 80),
        tls,
        netloc,
        parts.path.rstrip("/"),
    )


def request_head(
    method: str,
    where: Origin,
    path: str,
    headers: Mapping[str, str],
    length: int | None,
) -> bytes:
    """The request's line and headers, as sent. A header whose name or value holds a line
    break is left out (the gateway's server refuses those from clients anyway)."""
    lines = [f"{method} {where.base_path}{path} HTTP/1.1\r\nHost: {where.host_header}\r\n"]
    for name, value in headers.items():
        if name.lower() in _OWN_HEADERS or "\n" in value or "\r" in value or "\n" in name:
            continue
        lines.append(f"{name}: {value}\r\n")
    if length is not None:
        lines.append(f"Content-Length: {length}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("utf-8", "surrogateescape")


class UpstreamResponse:
    """A response on one connection: its head once ``ready``, then its body.

    The body is read with ``readany``/``read`` (buffered) or handed to a sink (``tap``); a
    ``set_exception`` (an interrupt, the idle watchdog) fails it either way.
    """

    __slots__ = (
        "_buf",
        "_conn",
        "_exc",
        "_head",
        "_head_exc",
        "_headers",
        "_paused",
        "_pieces",
        "_sink",
        "_size",
        "_waiter",
        "complete",
        "eof",
        "keep_alive",
        "parser",
        "status",
        "until_close",
    )

    def __init__(self, conn: UpstreamConnection) -> None:
        self._conn = conn
        self.parser = httptools.HttpResponseParser(self)
        self._head: asyncio.Future[None] = conn.loop.create_future()
        self._head_exc: BaseException | None = None
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._pieces: list[bytes] = []  # the body decoded from the current socket read
        self._buf: list[bytes] = []
        self._size = 0
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: StreamSink | None = None
        self._paused = False  # the sink asked to stop reading
        self.status = 0
        self.complete = False  # the parser saw the message end
        self.keep_alive = False  # and the connection may carry another (both sides agree)
        self.eof = False  # the body ended (complete, or closed where that is its end)
        self.until_close = False  # no length, not chunked: the body ends with the connection

    # -- the head --------------------------------------------------------------------

    async def ready(self) -> None:
        """Wait for the head; raise what ended the exchange before it came."""
        if not self._head.done():
            await self._head
        if self._head_exc is not None:
            raise self._head_exc

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        return CIMultiDictProxy(self._headers)

    @property
    def content_type(self) -> str:
        raw = self._headers.get("Content-Type")
        if not raw:
            return "application/octet-stream"
        return raw.partition(";")[0].strip().lower()

    # -- httptools' callbacks (inside UpstreamConnection.data_received) ----------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        headers = self._headers
        self.until_close = (
            "Content-Length" not in headers
            and "Transfer-Encoding" not in headers
            and self.status not in (204, 304)
            and self.status >= 200
        )
        if not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
        # Asked now: llhttp forgets the message's flags once this callback returns.
        self.keep_alive = self.parser.should_keep_alive()

    # -- the connection's side ---------------------------------------------------------

    def _flush(self) -> None:
        """After a socket read: hand on what it decoded, as one piece, then the end."""
        pieces = self._pieces
        if pieces:
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            pieces.clear()
            self._feed(data)
        if self.complete and not self.eof:
            self._end()

    def _feed(self, data: bytes) -> None:
        if self._exc is not None:
            return
        sink = self._sink
        if sink is not None:
            if sink.on_data(data) and self._sink is sink and self._exc is None:
                self._paused = True
                self._conn.pause_reading()
            return
        self._buf.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER:
            self._conn.pause_reading()
        self._wake()

    def _end(self) -> None:
        if self.eof or self._exc is not None:
            return
        self.eof = True
        sink = self._sink
        if sink is not None:
            if not self._paused:
                sink.on_end()  # else at resume(): the sink is told in order
        else:
            self._wake()

    def _lost(self) -> None:
        """The connection closed."""
        if not self._head.done():
            self._head_exc = Disconnected("connection closed before the response head")
            self._head.set_result(None)
            return
        self._flush()
        if self.eof:
            return
        if self.until_close and self._exc is None:
            self._end()
        else:
            self.set_exception(CutShort("connection closed before the end of the body"))

    def _broke(self, exc: BaseException) -> None:
        if not self._head.done():
            self._head_exc = exc
            self._head.set_result(None)
        else:
            self.set_exception(exc)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the reader's side (backends.upstream.client.UpstreamBody) -----------------------------

    def set_exception(self, exc: BaseException) -> None:
        """Fail the body (and the wait for the head, if it is still on)."""
        if not self._head.done():
            self._head_exc = exc
            self._head.set_result(None)
        if self.eof or self._exc is not None:
            return
        self._exc = exc
        self._conn.reusable = False
        sink = self._sink
        if sink is not None:
            sink.on_error(exc)
        else:
            self._wake()

    def exception(self) -> BaseException | None:
        return self._exc

    async def readany(self) -> bytes:
        """What has come of the body since the last read; b"" at its end."""
        while True:
            if self._exc is not None:
                raise self._exc
            if self._buf:
                buf = self._buf
                data = buf[0] if len(buf) == 1 else b"".join(buf)
                buf.clear()
                if self._size > HIGH_WATER:
                    self._conn.resume_reading()
                self._size = 0
                return data
            if self.eof:
                return b""
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read(self, n: int = -1) -> bytes:
        """The whole body (``n`` is not supported: whole bodies only)."""
        assert n == -1
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    # -- the tap: the body straight to a sink --------------------------------------------

    def tap(self, sink: StreamSink) -> UpstreamResponse | None:
        """Hand the rest of the body to ``sink``, from the read callback; None if it has
        failed already (the caller reads it the usual way, and meets the error)."""
        if self._exc is not None:
            return None
        self._sink = sink
        if self._buf:
            buf, self._buf = self._buf, []
            was, self._size = self._size, 0
            if was > HIGH_WATER:
                self._conn.resume_reading()
            self._feed(buf[0] if len(buf) == 1 else b"".join(buf))
        if self.eof and not self._paused and self._sink is sink:
            sink.on_end()
        return self

    @property
    def tapped(self) -> bool:
        return self._sink is not None

    @property
    def paused(self) -> bool:
        """Whether reading stopped at the sink's request."""
        return self._paused

    def resume(self) -> None:
        """Read again after the sink asked to stop."""
        if not self._paused:
            return
        self._paused = False
        sink = self._sink
        if self.eof:
            if sink is not None and self._exc is None:
                sink.on_end()
            return
        self._conn.resume_reading()

    def close(self) -> None:
        """Detach the sink: the body is read the usual way again (the tap's end)."""
        self._sink = None


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to a backend; one response on it at a time."""

    __slots__ = (
        "_drain",
        "_reading_paused",
        "_write_paused",
        "idle_since",
        "key",
        "loop",
        "lost",
        "pool",
        "response",
        "reusable",
        "transport",
    )

    def __init__(self, pool: ConnectionPool, key: Origin) -> None:
        self.pool = pool
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.reusable = True
        self.lost = False
        self.idle_since = 0.0  # when it went back to the pool (loop time)
        self._reading_paused = False
        self._write_paused = False
        self._drain: asyncio.Future[None] | None = None

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.transport is not None:
            return
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        resp = self.response
        if resp is None or resp.complete:  # a backend talking out of turn: not to be reused
            self.close()
            return
        try:
            resp.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            resp._broke(BadFraming("the backend switched protocols"))
            self.close()
            return
        except httptools.HttpParserError as exc:
            resp._flush()
            resp._broke(BadFraming(str(exc) or "malformed response"))
            self.close()
            return
        resp._flush()

    def eof_received(self) -> bool | None:
        return None  # close: this client never half-closes

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        self.reusable = False
        self.pool._gone(self)
        resp = self.response
        if resp is not None:
            resp._lost()
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    # -- the client's side -------------------------------------------------------------

    async def drain(self) -> None:
        while self._write_paused and not self.lost:
            self._drain = self.loop.create_future()
            try:
                await self._drain
            finally:
                self._drain = None
        if self.lost:
            raise Disconnected("connection closed while the request was sent")

    def pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None and not self.lost:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.lost:
            self._reading_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    def expire(self) -> None:
        self.pool._drop_idle(self)
        self.close()


class ConnectionPool:
    """Keep-alive connections per origin; at most ``limit`` open at once (0: no limit)."""

    def __init__(self, *, connect_timeout: float, keepalive_timeout: float, limit: int = 0) -> None:
        self.connect_timeout = connect_timeout
        self.keepalive_timeout = keepalive_timeout
        self.limit = limit
        self._idle: dict[Origin, list[UpstreamConnection]] = {}
        self._open: set[UpstreamConnection] = set()
        self._connecting = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._tls: ssl.SSLContext | None = None
        # One timer for the pool's idle connections, not one per request: it closes those
        # idle for the keep-alive timeout, then waits for the next to be.
        self._sweep: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        """Connections open (in use or idle)."""
        return len(self._open)

    def idle(self) -> int:
        return sum(len(conns) for conns in self._idle.values())

    def idle_origins(self) -> int:
        """Origins with idle connections kept: none is kept for an origin without any (with
        backends discovered and gone, the origins seen would otherwise only grow)."""
        return len(self._idle)

    def tapped(self) -> list[UpstreamResponse]:
        """The responses now read by a sink (for tests and debugging)."""
        return [c.response for c in self._open if c.response is not None and c.response.tapped]

    async def request(
        self,
        method: str,
        url: str,
        path: str,
        headers: Mapping[str, str],
        *,
        body: bytes | None = None,
        stream: AsyncIterator[bytes] | None = None,
        length: int | None = None,
    ) -> UpstreamResponse:
        """Send a request; return its response once the head has come. ``stream`` sends a body
        of ``length`` bytes as it is read. Raises ``Broken`` (and the caller's cancellation)."""
        key = origin(url)
        if body is not None:
            length = len(body)
        head = request_head(method, key, path, headers, length)
        conn = await self._acquire(key)
        resp = UpstreamResponse(conn)
        conn.response = resp
        transport = conn.transport
        assert transport is not None
        try:
            if stream is None:
                transport.write(head + body if body else head)
            else:
                transport.write(head)
                async for piece in stream:
                    transport.write(piece)
                    await conn.drain()
            await resp.ready()
        except BaseException:
            conn.close()
            raise
        return resp

    def release(self, resp: UpstreamResponse, *, complete: bool) -> None:
        """The caller is done with ``resp``: its connection goes back to the pool if the body
        was read to its end and both sides allow it; else it is closed (which is how a backend
        learns that nobody waits for the rest)."""
        conn = resp._conn
        if conn.response is not resp:
            return
        conn.response = None
        resp._sink = None
        if (
            complete
            and resp.complete
            and resp._exc is None
            and conn.reusable
            and not conn.lost
            and resp.keep_alive
        ):
            conn.resume_reading()
            conn.idle_since = conn.loop.time()
            self._idle.setdefault(conn.key, []).append(conn)  # oldest first
            if self._sweep is None:
                self._sweep = conn.loop.call_later(self.keepalive_timeout, self._expire_idle)
            self._wake_one()
        else:
            conn.close()

    async def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- connections -----------------------------------------------------------------

    async def _acquire(self, key: Origin) -> UpstreamConnection:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()  # the most recent: the least likely to be closing
            if not idle:
                del self._idle[key]
            if conn.loop.time() - conn.idle_since >= self.keepalive_timeout:
                conn.close()  # expired, and the sweep has not come yet
                continue
            if not conn.lost and conn.transport is not None and not conn.transport.is_closing():
                return conn
        while self.limit and len(self._open) + self._connecting >= self.limit:
            if not self._close_an_idle():  # else wait for a connection to close or come back
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                try:
                    await waiter
                finally:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
                idle = self._idle.get(key)
                if idle:
                    return await self._acquire(key)
        return await self._connect(key)

    async def _connect(self, key: Origin) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        conn = UpstreamConnection(self, key)
        self._connecting += 1
        try:
            async with asyncio.timeout(self.connect_timeout or None):
                transport, _ = await loop.create_connection(
                    lambda: conn,
                    key.host,
                    key.port,
                    ssl=self._tls_context() if key.tls else None,
                )
        except TimeoutError as exc:
            raise ConnectTimeout("connect timed out") from exc
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
            raise ConnectFailed(reason) from exc
        finally:
            self._connecting -= 1
            self._wake_one()
        if conn.lost:
            raise Disconnected("connection closed as it was made")
        conn.connection_made(transport)  # uvloop calls it a little later
        self._open.add(conn)
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _close_an_idle(self) -> bool:
        """Make room: close the oldest idle connection (to any origin), counted gone now."""
        for conns in self._idle.values():
            if conns:
                conn = conns[0]
                self._open.discard(conn)
                conn.expire()
                return True
        return False

    def _expire_idle(self) -> None:
        """Close the connections idle for the keep-alive timeout; come back for the next."""
        self._sweep = None
        loop = asyncio.get_running_loop()
        # A timer may run a hair early: a connection that close to its end is closed now.
        now, ttl = loop.time() + 0.005, self.keepalive_timeout
        nearest: float | None = None
        for conns in list(self._idle.values()):
            while conns and now - conns[0].idle_since >= ttl:
                conns[0].expire()  # drops it from ``conns`` (and the origin when empty)
            if conns and (nearest is None or conns[0].idle_since < nearest):
                nearest = conns[0].idle_since
        if nearest is not None:
            self._sweep = loop.call_at(nearest + ttl, self._expire_idle)

    def _drop_idle(self, conn: UpstreamConnection) -> None:
        conns = self._idle.get(conn.key)
        if conns and conn in conns:
            conns.remove(conn)
            if not conns:
                del self._idle[conn.key]

    def _gone(self, conn: UpstreamConnection) -> None:
        self._open.discard(conn)
        self._drop_idle(conn)
        self._wake_one()

    def _wake_one(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
                return
