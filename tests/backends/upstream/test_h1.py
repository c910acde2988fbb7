"""The upstream HTTP/1.1 client (``backends.upstream.h1``) against loopback servers that send exact
bytes, on asyncio's loop and on uvloop (the one ``serve`` runs on)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import uvloop

from backends.upstream import h1

RUNNERS = pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
EVENTS = [b"data: %d\n\n" % i for i in range(5)]


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class Server:
    """A loopback server: ``script(server, reader, writer)`` per connection."""

    def __init__(self, script: Callable[..., Awaitable[None]]) -> None:
        self.script = script
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.connections = 0
        self.closed = 0
        self.done = asyncio.Event()  # a connection was closed
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.closed += 1
            self.done.set()

    async def request(self, reader: asyncio.StreamReader) -> None:
        """Read one request: its head and its body (by its Content-Length)."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        self.heads.append(head)
        self.bodies.append(await reader.readexactly(length))


def pool(**kw: Any) -> h1.ConnectionPool:
    return h1.ConnectionPool(connect_timeout=2.0, keepalive_timeout=kw.pop("keepalive", 2.0), **kw)


class Sink:
    def __init__(self, stop_after: int = 0) -> None:
        self.data: list[bytes] = []
        self.ended = asyncio.Event()
        self.complete = False
        self.error: BaseException | None = None
        self.stop_after = stop_after

    def on_data(self, data: bytes) -> bool:
        self.data.append(data)
        return bool(self.stop_after) and len(self.data) >= self.stop_after

    def on_end(self) -> None:
        self.complete = True
        self.ended.set()

    def on_error(self, exc: BaseException) -> None:
        self.error = exc
        self.ended.set()


def run_test(run: Callable[[Any], Any], test: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        await asyncio.wait_for(test(), 10)

    run(main())


async def paced_stream(srv: Server, reader: Any, writer: Any, requests: int = 2) -> None:
    """Per request: the head and one event, then two events in one write, then the rest."""
    for _ in range(requests):
        await srv.request(reader)
        writer.write(SSE_HEAD + chunk(EVENTS[0]))
        await writer.drain()
        await asyncio.sleep(0.02)  # sleep-ok: the first event is read alone
        writer.write(chunk(EVENTS[1]) + chunk(EVENTS[2]))
        await writer.drain()
        await asyncio.sleep(0.02)  # sleep-ok: then the rest, with the last chunk
        writer.write(chunk(EVENTS[3]) + chunk(EVENTS[4]) + b"0\r\n\r\n")
        await writer.drain()


@RUNNERS
def test_a_stream_is_read_then_tapped_and_its_connection_is_reused(run: Any) -> None:
    async def test() -> None:
        async with Server(paced_stream) as srv:
            p = pool()
            for _ in range(2):
                resp = await p.request("POST", srv.url, "/v1/chat", {"X-A": "1"}, body=b'{"a":1}')
                assert (resp.status, resp.content_type) == (200, "text/event-stream")
                assert await resp.readany() == EVENTS[0]
                sink = Sink()
                assert resp.tap(sink) is resp
                await sink.ended.wait()
                assert sink.complete
                assert sink.error is None
                assert b"".join(sink.data) == b"".join(EVENTS[1:])
                assert len(sink.data) == 2  # one piece per socket read, not one per HTTP chunk
                p.release(resp, complete=True)
            assert srv.connections == 1  # kept alive and reused
            assert srv.bodies == [b'{"a":1}', b'{"a":1}']
            head = srv.heads[0]
            assert head.startswith(b"POST /v1/chat HTTP/1.1\r\nHost: 127.0.0.1:")
            assert b"\r\nX-A: 1\r\n" in head
            assert b"\r\nContent-Length: 7\r\n" in head
            await p.close()

    run_test(run, test)


@RUNNERS
def test_a_length_delimited_body_and_a_body_that_ends_with_its_connection(run: Any) -> None:
    async def script(srv: Server, reader: Any, writer: Any) -> None:
        await srv.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n")
        writer.write(b'Content-Length: 11\r\n\r\n{"ok":')
        await writer.drain()
        await asyncio.sleep(0.01)  # sleep-ok: the body in two reads
        writer.write(b"true}")
        await srv.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        await writer.drain()

    async def test() -> None:
        async with Server(script) as srv:
            p = pool()
            resp = await p.request("GET", srv.url, "/a", {})
            assert resp.content_type == "application/json"
            assert await resp.read() == b'{"ok":true}'
            p.release(resp, complete=True)
            resp = await p.request("GET", srv.url, "/b", {})
            assert resp.content_type == "application/octet-stream"  # none given
            assert await resp.read() == b"until the end"
            p.release(resp, complete=True)
            assert srv.connections == 1
            assert len(p) == 0  # not kept: it ended with the body
            await p.close()

    run_test(run, test)


@RUNNERS
def test_bad_framing_fails_the_read_and_the_tap(run: Any) -> None:
    async def script(srv: Server, reader: Any, writer: Any) -> None:
        await srv.request(reader)
        writer.write(SSE_HEAD + chunk(EVENTS[0]))
        await writer.drain()
        await asyncio.sleep(0.02)  # sleep-ok: after the first read
        writer.write(b"zz\r\nnot a chunk\r\n")
        await writer.drain()
        await asyncio.sleep(1)  # sleep-ok: the client closes

    async def test() -> None:
        async with Server(script) as srv:
            p = pool()
            resp = await p.request("POST", srv.url, "/", {}, body=b"")
            assert await resp.readany() == EVENTS[0]
            with pytest.raises(h1.BadFraming):
                await resp.readany()
            p.release(resp, complete=False)
            resp = await p.request("POST", srv.url, "/", {}, body=b"")  # a new connection
            sink = Sink()
            resp.tap(sink)
            await sink.ended.wait()
            assert isinstance(sink.error, h1.BadFraming)
            assert srv.connections == 2
            await p.close()

    run_test(run, test)


@RUNNERS
def test_a_connection_lost_before_the_head_or_mid_body(run: Any) -> None:
    async def script(srv: Server, reader: Any, writer: Any) -> None:
        await srv.request(reader)
        if srv.connections == 2:
            writer.write(SSE_HEAD + chunk(EVENTS[0]))
            await writer.drain()
        writer.transport.abort()

    async def test() -> None:
        async with Server(script) as srv:
            p = pool()
            with pytest.raises(h1.Disconnected):
                await p.request("POST", srv.url, "/", {}, body=b"x")
            resp = await p.request("POST", srv.url, "/", {}, body=b"x")
            with pytest.raises(h1.CutShort):
                await resp.read()
            p.release(resp, complete=False)
            assert len(p) == 0
            await p.close()

    run_test(run, test)


@RUNNERS
def test_a_refused_connection_says_why(run: Any) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now

    async def test() -> None:
        p = pool()
        with pytest.raises(h1.ConnectFailed, match="refused"):
            await p.request("GET", f"http://127.0.0.1:{port}", "/health", {})
        assert len(p) == 0
        await p.close()

    run_test(run, test)


@RUNNERS
def test_releasing_an_unfinished_body_closes_its_connection(run: Any) -> None:
    """Closing is how a backend learns nobody waits for the rest (vLLM aborts the request)."""
    seen: dict[str, bool] = {}

    async def script(srv: Server, reader: Any, writer: Any) -> None:
        await srv.request(reader)
        writer.write(SSE_HEAD + chunk(EVENTS[0]))
        await writer.drain()
        seen["eof"] = await reader.read(1) == b""

    async def test() -> None:
        async with Server(script) as srv:
            p = pool()
            resp = await p.request("POST", srv.url, "/", {}, body=b"x")
            assert await resp.readany() == EVENTS[0]
            p.release(resp, complete=False)
            await asyncio.wait_for(srv.done.wait(), 5)
            assert seen == {"eof": True}
            assert len(p) == 0
            await p.close()

    run_test(run, test)


@RUNNERS
def test_an_unread_body_stops_the_socket_being_read_and_a_full_sink_too(run: Any) -> None:
    big = b"data: " + b"x" * 8186 + b"\n\n"  # 8 KiB events
    written: dict[str, int] = {"n": 0}

    async def script(srv: Server, reader: Any, writer: Any) -> None:
        await srv.request(reader)
        writer.transport.set_write_buffer_limits(high=1 << 14)
        writer.write(SSE_HEAD)
        for _ in range(2048):  # 16 MiB: far more than the socket buffers hold
            writer.write(chunk(big))
            await writer.drain()  # waits while the client does not read
            written["n"] += 1
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def settled() -> int:
        before = -1
        while before != written["n"]:
            before = written["n"]
            await asyncio.sleep(0.2)  # sleep-ok: until the server is held back
        return before

    async def test() -> None:
        async with Server(script) as srv:
            p = pool()
            resp = await p.request("POST", srv.url, "/", {}, body=b"x")
            held = await settled()
            assert held < 2048  # the client stopped reading: the server waits
            assert resp._size <= h1.HIGH_WATER + 2 * len(big) + 65536
            sink = Sink(stop_after=1)  # full after its first piece
            resp.tap(sink)
            assert resp.paused
            await settled()
            assert not sink.ended.is_set()
            sink.stop_after = 0
            resp.resume()
            await sink.ended.wait()
            assert sink.complete
            assert b"".join(sink.data) == big * 2048
            p.release(resp, complete=True)
            await p.close()

    run_test(run, test)


@RUNNERS
def test_a_streamed_request_body_and_headers_that_are_not_sent(run: Any) -> None:
    async def script(srv: Server, reader: Any, writer: Any) -> None:
        await srv.request(reader)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()
        await srv.request(reader)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    async def pieces() -> AsyncIterator[bytes]:
        for _ in range(64):
            yield b"y" * 65536
            await asyncio.sleep(0)

    async def test() -> None:
        async with Server(script) as srv:
            p = pool()
            headers = {"X-Bad": "a\r\nX-Injected: 1", "Host": "elsewhere", "Content-Length": "3"}
            resp = await p.request("POST", srv.url, "/up", headers, stream=pieces(), length=1 << 22)
            assert resp.status == 204
            assert await resp.read() == b""
            p.release(resp, complete=True)
            assert srv.bodies[0] == b"y" * (1 << 22)
            head = srv.heads[0]
            assert b"X-Injected" not in head
            assert b"elsewhere" not in head
            assert head.count(b"Content-Length") == 1
            assert b"Content-Length: 4194304" in head
            resp = await p.request("POST", srv.url, "/again", {}, body=b"")  # reused after a 204
            assert resp.status == 204
            p.release(resp, complete=True)
            assert srv.connections == 1
            await p.close()

    run_test(run, test)


@RUNNERS
def test_a_limit_on_connections_makes_requests_wait_for_one(run: Any) -> None:
    async def script(srv: Server, reader: Any, writer: Any) -> None:
        while True:
            await srv.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async def test() -> None:
        async with Server(script) as srv, Server(script) as other:
            p = pool(limit=1)
            first = await p.request("GET", srv.url, "/", {})
            second = asyncio.ensure_future(p.request("GET", srv.url, "/", {}))
            await asyncio.sleep(0.05)  # sleep-ok: the second waits for the only connection
            assert not second.done()
            assert await first.read() == b"ok"
            p.release(first, complete=True)
            resp = await second
            assert await resp.read() == b"ok"
            p.release(resp, complete=True)
            assert srv.connections == 1
            resp = await p.request("GET", other.url, "/", {})  # the idle one makes room
            assert await resp.read() == b"ok"
            p.release(resp, complete=True)
            assert len(p) == 1
            await p.close()

    run_test(run, test)


@RUNNERS
def test_an_idle_connection_expires_and_a_closed_one_is_not_reused(run: Any) -> None:
    async def script(srv: Server, reader: Any, writer: Any) -> None:
        await srv.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        if srv.connections == 1:
            await asyncio.sleep(0.3)  # sleep-ok: then the server closes it, idle
            return
        await asyncio.sleep(5)  # sleep-ok: held open; the client's keep-alive ends it

    async def test() -> None:
        async with Server(script) as srv:
            p = pool(keepalive=0.5)
            for _ in range(2):
                resp = await p.request("GET", srv.url, "/", {})
                assert await resp.read() == b"ok"
                p.release(resp, complete=True)
                await asyncio.sleep(0.4)  # sleep-ok: the first is closed by the server meanwhile
            assert srv.connections == 2
            assert p.idle() == 1
            await asyncio.sleep(0.3)  # sleep-ok: past the keep-alive timeout
            assert p.idle() == 0
            await p.close()

    run_test(run, test)


def test_origins_and_request_heads() -> None:
    o = h1.origin("https://user:pw@backend.example:8443/base/")
    assert (o.host, o.port, o.tls, o.host_header, o.base_path) == (
        "backend.example",
        8443,
        True,
        "backend.example:8443",
        "/base",
    )
    assert h1.origin("http://[::1]").host_header == "[::1]"
    assert h1.origin("http://[::1]").port == 80
    with pytest.raises(ValueError, match="not an http"):
        h1.origin("ftp://x")
    head = h1.request_head("GET", h1.origin("http://b:1/p"), "/v1/models?x=1", {"A": "é"}, None)
    assert head == "GET /p/v1/models?x=1 HTTP/1.1\r\nHost: b:1\r\nA: é\r\n\r\n".encode()


@RUNNERS
def test_a_connection_not_made_in_time_times_out(run: Any) -> None:
    """A listener whose accept queue is full drops new connections' SYNs: they hang."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):  # fill the accept queue (Linux takes backlog + 1)
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        fillers.append(s)

    async def test() -> None:
        p = h1.ConnectionPool(connect_timeout=0.3, keepalive_timeout=1.0)
        with pytest.raises(h1.ConnectTimeout):
            await p.request("GET", f"http://127.0.0.1:{port}", "/", {})
        assert len(p) == 0
        await p.close()

    try:
        run_test(run, test)
    finally:
        for s in [*fillers, listener]:
            s.close()


@RUNNERS
def test_an_origin_whose_idle_connections_are_all_taken_is_not_kept(run: Any) -> None:
    async def script(srv: Server, reader: Any, writer: Any) -> None:
        for _ in range(2):  # one connection, reused
            await srv.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async def test() -> None:
        async with Server(script) as srv:
            p = pool(keepalive=30)
            resp = await p.request("GET", srv.url, "/", {})
            assert await resp.read() == b"ok"
            p.release(resp, complete=True)
            assert (p.idle(), p.idle_origins()) == (1, 1)
            resp = await p.request("GET", srv.url, "/", {})  # the idle one, taken
            # Nothing is kept for the origin now (with backends discovered and gone, the
            # origins ever seen would otherwise only grow).
            assert (p.idle(), p.idle_origins()) == (0, 0)
            assert await resp.read() == b"ok"
            p.release(resp, complete=True)
            assert (p.idle(), p.idle_origins(), srv.connections) == (1, 1, 1)
            await p.close()
            assert (p.idle(), p.idle_origins()) == (0, 0)

    run_test(run, test)


@RUNNERS
def test_idle_connections_each_expire_after_the_keepalive_timeout_on_one_timer(run: Any) -> None:
    async def script(srv: Server, reader: Any, writer: Any) -> None:
        while True:
            await srv.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async def fetch(p: h1.ConnectionPool, url: str) -> h1.UpstreamResponse:
        resp = await p.request("GET", url, "/", {})
        assert await resp.read() == b"ok"
        return resp

    async def test() -> None:
        async with Server(script) as srv:
            p = pool(keepalive=0.4)
            first, second = await fetch(p, srv.url), await fetch(p, srv.url)  # two connections
            p.release(first, complete=True)
            await asyncio.sleep(0.2)  # sleep-ok: the second goes idle 0.2 s after the first
            p.release(second, complete=True)
            assert p.idle() == 2
            await asyncio.sleep(0.3)  # sleep-ok: the first's keep-alive is over, not the second's
            assert p.idle() == 1
            again = await fetch(p, srv.url)  # the second, reused
            assert srv.connections == 2
            p.release(again, complete=True)
            await asyncio.sleep(0.5)  # sleep-ok: past its keep-alive too
            assert p.idle() == 0
            assert len(p) == 0
            await p.close()

    run_test(run, test)
