"""The server through real sockets on 127.0.0.1: keep-alive, pipelining, bodies, streams,
disconnects, timeouts, graceful stop, TLS; with aiohttp's client and a raw socket as clients."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
import uvloop
from aiohttp import web

from backends.errors import BodyTooLarge
from gateway.http import Request, Response, Routes, StreamResponse, json_response
from tests.gateway.http.rig import RawClient, one_route, routed, serving
from tests.waiting import wait_for

GET = b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"


async def echo(request: Request) -> Response:
    body = await request.read()
    return Response(body=request.path_qs.encode() + b"|" + body, content_type="text/plain")


# -- keep-alive and pipelining ------------------------------------------------------------


async def test_a_kept_alive_connection_serves_one_request_after_another() -> None:
    async with serving(one_route(echo)) as srv, await RawClient.open(srv.port) as c:
        for i in range(3):
            await c.send(b"GET /x?i=%d HTTP/1.1\r\nHost: t\r\n\r\n" % i)
            reply = await c.reply()
            assert reply.status == 200
            assert reply.body == b"/x?i=%d|" % i
            assert "Connection" not in reply.headers
            assert "Date" in reply.headers
            assert "Server" not in reply.headers
        assert srv.open_connections() == 1


async def test_aiohttps_client_reuses_its_one_connection() -> None:
    async def peer_port(request: Request) -> Response:
        assert request.transport is not None
        return json_response({"port": request.transport.get_extra_info("peername")[1]})

    async with (
        serving(one_route(peer_port)) as srv,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s,
    ):
        ports = set()
        for _ in range(3):
            async with s.get(srv.url + "/x") as r:
                assert r.status == 200
                assert r.headers["Content-Type"] == "application/json"
                ports.add((await r.json())["port"])
        assert len(ports) == 1


async def test_pipelined_requests_are_answered_in_order_one_at_a_time() -> None:
    release = asyncio.Event()
    started: list[str] = []

    async def handler(request: Request) -> Response:
        started.append(request.path)
        if request.path == "/1":
            await release.wait()
        return Response(body=request.path.encode())

    router = Routes()
    for path in ("/1", "/2", "/3"):
        router.add("GET", path, handler)
    async with serving(routed(router)) as srv, await RawClient.open(srv.port) as c:
        await c.send(b"".join(b"GET /%d HTTP/1.1\r\nHost: t\r\n\r\n" % i for i in (1, 2, 3)))
        await wait_for(lambda: started == ["/1"], what="the first handler")
        assert started == ["/1"]  # the others wait their turn
        release.set()
        bodies = [(await c.reply()).body for _ in range(3)]
        assert bodies == [b"/1", b"/2", b"/3"]
        assert started == ["/1", "/2", "/3"]


async def test_http_1_0_closes_unless_it_asks_for_keep_alive() -> None:
    async with serving(one_route(echo)) as srv:
        async with await RawClient.open(srv.port) as c:
            await c.send(b"GET /x HTTP/1.0\r\n\r\n")
            reply = await c.reply()
            assert reply.status == 200
            assert reply.head.startswith(b"HTTP/1.1 200 OK\r\n")
            assert reply.headers["Connection"] == "close"
            assert await c.rest() == b""
        async with await RawClient.open(srv.port) as c:
            for _ in range(2):
                await c.send(b"GET /x HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
                reply = await c.reply()
                assert reply.headers["Connection"] == "keep-alive"


async def test_connection_close_from_the_client_is_honoured() -> None:
    async with serving(one_route(echo)) as srv, await RawClient.open(srv.port) as c:
        await c.send(b"GET /x HTTP/1.1\r\nConnection: close\r\n\r\nGET /x HTTP/1.1\r\n\r\n")
        reply = await c.reply()
        assert reply.headers["Connection"] == "close"
        assert await c.rest() == b""  # the second request is never read
        await wait_for(lambda: srv.open_connections() == 0, what="the connection closed")


async def test_an_answer_before_the_whole_body_closes_the_connection() -> None:
    calls: list[str] = []

    async def refuse(request: Request) -> Response:
        calls.append(request.path)
        return json_response({"error": "no"}, status=401)

    async with serving(one_route(refuse)) as srv, await RawClient.open(srv.port) as c:
        # The body's first bytes look like a request: they must never be read as one.
        await c.send(b"POST /x HTTP/1.1\r\nContent-Length: 1000\r\n\r\nGET /x HTTP/1.1\r\n\r\n")
        reply = await c.reply()
        assert reply.status == 401
        assert reply.headers["Connection"] == "close"
        assert await c.rest() == b""
    assert calls == ["/x"]


# -- request bodies -----------------------------------------------------------------------


async def test_a_chunked_body_is_read_whole() -> None:
    async with serving(one_route(echo)) as srv, await RawClient.open(srv.port) as c:
        await c.send(b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await c.send(b"6\r\n world\r\n0\r\n\r\n")
        reply = await c.reply()
        assert reply.body == b"/x|hello world"


async def test_a_chunked_body_read_in_pieces_with_iter_chunked() -> None:
    pieces: list[bytes] = []

    async def collect(request: Request) -> Response:
        async for piece in request.content.iter_chunked(4):
            pieces.append(piece)
        assert request.content.at_eof()
        return Response(body=b"".join(pieces))

    body = b"0123456789abcdefghij"
    async with serving(one_route(collect)) as srv, await RawClient.open(srv.port) as c:
        await c.send(b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(body), 7):
            part = body[i : i + 7]
            await c.send(b"%x\r\n%b\r\n" % (len(part), part))
        await c.send(b"0\r\n\r\n")
        assert (await c.reply()).body == body
    assert all(0 < len(p) <= 4 for p in pieces)


async def test_a_body_that_came_with_the_head_is_already_at_its_end() -> None:
    seen: list[bool] = []

    async def check(request: Request) -> Response:
        seen.append(request.content.is_eof())
        return Response(body=await request.read())

    async with serving(one_route(check)) as srv, await RawClient.open(srv.port) as c:
        await c.send(b"POST /x HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc")
        assert (await c.reply()).body == b"abc"
        await c.send(GET)
        await c.reply()
    assert seen == [True, True]


async def test_100_continue_is_sent_when_the_handler_reads_the_body() -> None:
    async with serving(one_route(echo)) as srv, await RawClient.open(srv.port) as c:
        await c.send(b"POST /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        interim = await c.reply()
        assert interim.status == 100
        assert interim.head == b"HTTP/1.1 100 Continue\r\n\r\n"
        await c.send(b"hello")
        reply = await c.reply()
        assert (reply.status, reply.body) == (200, b"/x|hello")


async def test_no_100_continue_for_a_request_answered_without_its_body() -> None:
    async def refuse(request: Request) -> Response:
        return json_response({"error": "who are you"}, status=401)

    async with serving(one_route(refuse)) as srv, await RawClient.open(srv.port) as c:
        await c.send(b"POST /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        reply = await c.reply()
        assert reply.status == 401
        assert reply.headers["Connection"] == "close"  # the body was never read
        assert await c.rest() == b""


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_reading_past_max_body_bytes_raises_body_too_large(framing: str) -> None:
    caught: list[str] = []

    async def read(request: Request) -> Response:
        try:
            await request.read()
        except BodyTooLarge as exc:
            caught.append(exc.message)
            return json_response(exc.envelope(), status=exc.status)
        return Response()

    body = b"x" * 101
    if framing == "chunked":
        request = (
            b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n65\r\n%b\r\n0\r\n\r\n" % body
        )
    else:
        request = b"POST /x HTTP/1.1\r\nContent-Length: 101\r\n\r\n" + body
    async with (
        serving(one_route(read), max_body_bytes=100) as srv,
        await RawClient.open(srv.port) as c,
    ):
        await c.send(request)
        reply = await c.reply()
        assert reply.status == 413
        assert json.loads(reply.body)["error"]["code"] == "request_too_large"
    assert caught == ["Request body is larger than the limit of 100 bytes."]


async def test_a_big_body_is_read_with_the_socket_paused_and_resumed() -> None:
    async def count(request: Request) -> Response:
        size = 0
        while chunk := await request.content.readany():
            size += len(chunk)
        return json_response({"size": size})

    big = 3 * 1024 * 1024

    async def pieces() -> AsyncIterator[bytes]:
        for _ in range(big // 65536):
            yield b"z" * 65536

    async with (
        serving(one_route(count), max_body_bytes=big) as srv,
        aiohttp.ClientSession() as s,
        s.post(srv.url + "/x", data=pieces()) as r,
    ):
        assert (await r.json())["size"] == big


# -- the client going away ----------------------------------------------------------------


@pytest.mark.parametrize("waiting_for", ["upstream", "body"])
async def test_a_client_that_leaves_cancels_its_handler(waiting_for: str) -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def wait(request: Request) -> Response:
        started.set()
        try:
            if waiting_for == "body":
                await request.read()
            else:
                await asyncio.Event().wait()  # an upstream that never answers
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Response()

    async with serving(one_route(wait)) as srv:
        c = await RawClient.open(srv.port)
        await c.send(b"POST /x HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
        await asyncio.wait_for(started.wait(), 5)
        c.close()
        await asyncio.wait_for(cancelled.wait(), 5)
        await wait_for(lambda: srv.open_connections() == 0, what="the connection gone")


async def test_a_body_broken_mid_way_cancels_the_handler_and_is_refused() -> None:
    reading, cancelled = asyncio.Event(), asyncio.Event()

    async def read(request: Request) -> Response:
        reading.set()
        try:
            await request.read()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Response()

    with structlog.testing.capture_logs() as logs:
        async with serving(one_route(read)) as srv, await RawClient.open(srv.port) as c:
            await c.send(b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
            await asyncio.wait_for(reading.wait(), 5)
            await c.send(b"zz\r\n")
            reply = await c.reply()
            assert reply.status == 400
            assert reply.headers["Connection"] == "close"
            assert await c.rest() == b""
            await asyncio.wait_for(cancelled.wait(), 5)
    assert [e["status"] for e in logs if e["event"] == "http_refused"] == [400]


# -- answers ------------------------------------------------------------------------------


async def test_a_streams_head_goes_out_with_its_first_chunk_in_one_write() -> None:
    """(On asyncio's loop: uvloop's transports cannot be spied on; the next test covers it.)"""
    if isinstance(asyncio.get_running_loop(), uvloop.Loop):
        pytest.skip("uvloop's transport.write cannot be replaced")
    writes: list[bytes] = []
    go = asyncio.Event()

    async def stream(request: Request) -> StreamResponse:
        transport = request.transport
        assert transport is not None
        write = transport.write

        def spy(data: Any) -> None:
            writes.append(bytes(data))
            write(data)

        transport.write = spy  # type: ignore[method-assign]
        resp = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        assert writes == []  # the head is held
        await resp.write(b"data: 1\n\n")
        await go.wait()
        await resp.write(b"data: 2\n\n")
        await resp.write_eof()
        return resp

    async with serving(one_route(stream)) as srv, await RawClient.open(srv.port) as c:
        await c.send(GET)
        await wait_for(lambda: len(writes) > 0, what="a write")
        go.set()
        reply = await c.reply()
        assert reply.body == b"data: 1\n\ndata: 2\n\n"
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert writes[0].endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n")
    assert writes[1:] == [b"9\r\ndata: 2\n\n\r\n", b"0\r\n\r\n"]


async def test_a_streams_first_read_holds_its_head_and_first_chunk() -> None:
    go = asyncio.Event()

    async def stream(request: Request) -> StreamResponse:
        resp = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"first")
        await go.wait()
        await resp.write_eof(b"last")
        return resp

    async with serving(one_route(stream)) as srv, await RawClient.open(srv.port) as c:
        await c.send(GET)
        head = await asyncio.wait_for(c.reader.readuntil(b"first\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"Transfer-Encoding: chunked\r\n" in head
        go.set()
        assert await c.reader.readuntil(b"0\r\n\r\n") == b"4\r\nlast\r\n0\r\n\r\n"


async def test_stream_framings() -> None:
    async def stream(request: Request) -> StreamResponse:
        kind = request.query["kind"]
        resp = StreamResponse(headers={"X-Kind": kind})
        if kind == "length":
            resp.content_length = 6
        if kind != "unprepared":
            await resp.prepare(request)
            await resp.write(b"abc")
            await resp.write(b"def")
        if kind == "flushed":
            resp.flush_head()
        return resp  # the server ends it

    async with serving(one_route(stream)) as srv, await RawClient.open(srv.port) as c:
        await c.send(b"GET /x?kind=chunked HTTP/1.1\r\n\r\n")
        reply = await c.reply()
        assert (reply.headers["Transfer-Encoding"], reply.body) == ("chunked", b"abcdef")
        await c.send(b"GET /x?kind=length HTTP/1.1\r\n\r\n")
        reply = await c.reply()
        assert "Transfer-Encoding" not in reply.headers
        assert (reply.headers["Content-Length"], reply.body) == ("6", b"abcdef")
        await c.send(b"GET /x?kind=unprepared HTTP/1.1\r\n\r\n")
        reply = await c.reply()
        assert (reply.headers["Transfer-Encoding"], reply.body) == ("chunked", b"")
        await c.send(b"GET /x?kind=http10 HTTP/1.0\r\n\r\n")
        reply = await c.reply()  # no chunks for HTTP/1.0: the body ends with the connection
        assert "Transfer-Encoding" not in reply.headers
        assert reply.headers["Connection"] == "close"
        assert reply.body == b"abcdef"


async def test_a_get_route_answers_head_with_the_head_alone() -> None:
    async def hello(request: Request) -> Response:
        return Response(body=b"hello", content_type="text/plain")

    router = Routes()
    router.add("GET", "/x", hello)
    async with serving(routed(router)) as srv, await RawClient.open(srv.port) as c:
        await c.send(b"HEAD /x HTTP/1.1\r\n\r\n")
        reply = await c.reply(head_only=True)
        assert (reply.status, reply.headers["Content-Length"]) == (200, "5")
        await c.send(GET)  # had a body gone out, this would read it as the answer's head
        assert (await c.reply()).body == b"hello"


async def test_unknown_paths_are_404_and_wrong_methods_405_with_allow() -> None:
    async def ok(request: Request) -> Response:
        return Response()

    router = Routes()
    router.add("GET", "/v1/models", ok)
    router.add("POST", "/v1/chat/completions", ok)
    async with (
        serving(routed(router)) as srv,
        aiohttp.ClientSession() as s,
    ):
        async with s.get(srv.url + "/nope") as r:
            assert r.status == 404
            assert (await r.json())["error"]["message"] == "Not Found (GET /nope)"
        async with s.get(srv.url + "/v1/chat/completions") as r:
            assert r.status == 405
            assert r.headers["Allow"] == "POST"
            message = (await r.json())["error"]["message"]
            assert message == "Method Not Allowed (GET /v1/chat/completions)"
        async with s.delete(srv.url + "/v1/models") as r:
            assert (r.status, r.headers["Allow"]) == (405, "GET, HEAD")


async def test_the_request_as_the_handler_sees_it() -> None:
    key = web.RequestKey("k", str)
    seen: dict[str, Any] = {}

    async def look(request: Request) -> Response:
        request[key] = "v"
        request["plain"] = 1
        seen.update(
            method=request.method,
            path=request.path,
            path_qs=request.path_qs,
            query=list(request.query.items()),
            agent=request.headers["x-agent"],
            version=request.version,
            length=request.content_length,
            info=request.match_info,
            remote=request.remote,
            state=(request[key], request.get(key), request.get("missing", 0), request["plain"]),
        )
        return Response()

    router = Routes()
    router.add("POST", "/v1/responses/{response_id}/cancel", look)
    async with serving(routed(router)) as srv, await RawClient.open(srv.port) as c:
        await c.send(
            b"POST /v1/responses/r%201/cancel?a=1&b=&a=2 HTTP/1.1\r\n"
            b"X-Agent: t\r\nContent-Length: 2\r\n\r\nhi"
        )
        assert (await c.reply()).status == 200
    assert seen == {
        "method": "POST",
        "path": "/v1/responses/r 1/cancel",
        "path_qs": "/v1/responses/r%201/cancel?a=1&b=&a=2",
        "query": [("a", "1"), ("b", ""), ("a", "2")],
        "agent": "t",
        "version": (1, 1),
        "length": 2,
        "info": {"response_id": "r 1"},
        "remote": "127.0.0.1",
        "state": ("v", "v", 0, 1),
    }


async def test_a_handler_that_raises_gets_a_500_and_one_log_line() -> None:
    async def broken(request: Request) -> Response:
        if request.query.get("stream"):
            resp = StreamResponse()
            await resp.prepare(request)
            await resp.write(b"partial")
        raise RuntimeError("a bug")

    with structlog.testing.capture_logs() as logs:
        async with serving(one_route(broken)) as srv:
            async with await RawClient.open(srv.port) as c:
                await c.send(GET)
                reply = await c.reply()
                assert reply.status == 500
                assert reply.headers["Connection"] == "close"
                error = json.loads(reply.body)["error"]
                assert error["message"] == "The gateway failed to handle this request."
                assert await c.rest() == b""
            async with await RawClient.open(srv.port) as c:
                await c.send(b"GET /x?stream=1 HTTP/1.1\r\n\r\n")
                with pytest.raises(asyncio.IncompleteReadError):
                    await c.reply()  # cut off mid-answer
    errors = [e for e in logs if e["event"] == "unhandled_error"]
    assert len(errors) == 2
    assert all(e["log_level"] == "error" and e.get("exc_info") for e in errors)


async def test_server_name_adds_a_server_header() -> None:
    async with (
        serving(one_route(echo), server_name="gw/1") as srv,
        await RawClient.open(srv.port) as c,
    ):
        await c.send(GET)
        assert (await c.reply()).headers["Server"] == "gw/1"


# -- timeouts -----------------------------------------------------------------------------


async def test_keepalive_timeout_closes_an_idle_connection() -> None:
    async with serving(one_route(echo), keepalive_timeout=0.05) as srv:
        async with await RawClient.open(srv.port) as c:
            await c.send(GET)
            assert (await c.reply()).status == 200
            assert await c.rest() == b""  # closed silently
        async with await RawClient.open(srv.port) as silent:
            assert await silent.rest() == b""
        await wait_for(lambda: srv.open_connections() == 0, what="connections closed")


async def test_send_timeout_cuts_off_a_client_that_never_reads() -> None:
    reset = asyncio.Event()
    chunk = b"x" * 65536

    async def flood(request: Request) -> StreamResponse:
        resp = StreamResponse()
        await resp.prepare(request)
        try:
            while True:
                await resp.write(chunk)
        except ConnectionResetError:
            reset.set()
        return resp

    loop = asyncio.get_running_loop()
    async with serving(one_route(flood), send_timeout=0.1) as srv:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", srv.port))
            await loop.sock_sendall(sock, GET)
            await asyncio.wait_for(reset.wait(), 10)  # it never reads a byte
            await wait_for(lambda: srv.open_connections() == 0, what="the connection cut")
        finally:
            sock.close()


# -- graceful stop ------------------------------------------------------------------------


async def test_a_graceful_stop_finishes_streams_closes_idle_connections_refuses_new() -> None:
    finish, streaming = asyncio.Event(), asyncio.Event()

    async def handler(request: Request) -> StreamResponse:
        if request.path == "/idle":
            return Response(body=b"ok")
        resp = StreamResponse()
        await resp.prepare(request)
        await resp.write(b"one")
        streaming.set()
        await finish.wait()
        await resp.write_eof(b"two")
        return resp

    router = Routes()
    router.add("GET", "/idle", handler)
    router.add("GET", "/stream", handler)
    async with serving(routed(router), grace=10) as srv:
        idle = await RawClient.open(srv.port)
        await idle.send(b"GET /idle HTTP/1.1\r\n\r\n")
        assert (await idle.reply()).status == 200
        busy = await RawClient.open(srv.port)
        await busy.send(b"GET /stream HTTP/1.1\r\n\r\n")
        await asyncio.wait_for(streaming.wait(), 5)
        stopping = asyncio.create_task(srv.server.cleanup(10))
        assert await idle.rest() == b""  # closed at once
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", srv.port)
        assert not stopping.done()
        finish.set()
        reply = await busy.reply()
        assert reply.body == b"onetwo"
        assert await busy.rest() == b""
        await asyncio.wait_for(stopping, 5)
        idle.close()
        busy.close()


async def test_a_graceful_stop_answers_the_requests_already_queued() -> None:
    release = asyncio.Event()

    async def handler(request: Request) -> Response:
        if request.path == "/1":
            await release.wait()
        return Response(body=request.path.encode())

    router = Routes()
    router.add("GET", "/1", handler)
    router.add("GET", "/2", handler)
    async with serving(routed(router)) as srv, await RawClient.open(srv.port) as c:
        await c.send(b"GET /1 HTTP/1.1\r\n\r\nGET /2 HTTP/1.1\r\n\r\n")
        await wait_for(lambda: srv.open_connections() == 1, what="connected")
        stopping = asyncio.create_task(srv.server.cleanup(10))
        await asyncio.sleep(0)  # sleep-ok: let the stop begin before the first answer
        release.set()
        first, second = await c.reply(), await c.reply()
        assert (first.body, second.body) == (b"/1", b"/2")
        assert "Connection" not in first.headers
        assert second.headers["Connection"] == "close"
        assert await c.rest() == b""
        await asyncio.wait_for(stopping, 5)


async def test_a_graceful_stop_cancels_what_outlives_its_grace() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def stuck(request: Request) -> Response:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Response()

    async with serving(one_route(stuck)) as srv, await RawClient.open(srv.port) as c:
        await c.send(GET)
        await asyncio.wait_for(started.wait(), 5)
        await asyncio.wait_for(srv.server.cleanup(0.05), 5)
        assert cancelled.is_set()
        assert srv.open_connections() == 0
        assert await c.rest() == b""
        await srv.server.cleanup(0.05)  # again: nothing more to do


# -- TLS ----------------------------------------------------------------------------------


# Run in a child process, so that the cryptography package stays optional (and unseen by mypy).
_CRYPTOGRAPHY_CERT = """
import datetime, ipaddress, sys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
key = ec.generate_private_key(ec.SECP256R1())
name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
now = datetime.datetime.now(datetime.timezone.utc)
cert = (
    x509.CertificateBuilder().subject_name(name).issuer_name(name)
    .public_key(key.public_key()).serial_number(x509.random_serial_number())
    .not_valid_before(now - datetime.timedelta(minutes=1))
    .not_valid_after(now + datetime.timedelta(days=1))
    .add_extension(
        x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
        critical=False,
    )
    .sign(key, hashes.SHA256())
)
open(sys.argv[1], "wb").write(cert.public_bytes(serialization.Encoding.PEM))
open(sys.argv[2], "wb").write(key.private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
))
"""


def _self_signed(tmp: Path) -> tuple[Path, Path] | None:
    """A certificate for 127.0.0.1 and its key: by the cryptography package if installed,
    else by the openssl CLI; None if neither is there."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    if importlib.util.find_spec("cryptography") is not None:
        command = [sys.executable, "-c", _CRYPTOGRAPHY_CERT, str(cert), str(key)]
    elif (openssl := shutil.which("openssl")) is not None:
        command = [
            openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1",
        ]  # fmt: skip
    else:
        return None
    subprocess.run(command, check=True, capture_output=True, timeout=30)
    return cert, key


async def test_a_tls_round_trip(tmp_path: Path) -> None:
    made = _self_signed(tmp_path)
    if made is None:
        pytest.skip("neither the cryptography package nor the openssl CLI is available")
    cert, key = made
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    async with (
        serving(one_route(echo), tls=server_ctx) as srv,
        aiohttp.ClientSession() as s,
    ):
        for _ in range(2):
            url = f"https://127.0.0.1:{srv.port}/x"
            async with s.post(url, data=b"secret", ssl=client_ctx) as r:
                assert r.status == 200
                assert await r.read() == b"/x|secret"
        assert srv.open_connections() == 1


async def test_a_client_that_never_reads_a_whole_answer_is_cut_off_after_it() -> None:
    big = b"x" * (8 << 20)

    async def whole(request: Request) -> Response:
        return Response(body=big)

    loop = asyncio.get_running_loop()
    async with serving(one_route(whole), keepalive_timeout=0.05, send_timeout=0.1) as srv:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", srv.port))
            await loop.sock_sendall(sock, GET)
            await wait_for(lambda: srv.open_connections() == 0, what="the connection cut")
        finally:
            sock.close()


async def test_a_handler_raising_after_its_whole_answer_leaves_the_answer_whole() -> None:
    async def late_bug(request: Request) -> Response:
        resp = Response(body=b"done")
        await resp.prepare(request)
        await resp.write_eof()
        raise RuntimeError("after the answer")

    with structlog.testing.capture_logs() as logs:
        async with serving(one_route(late_bug)) as srv, await RawClient.open(srv.port) as c:
            await c.send(GET)
            assert (await c.reply()).body == b"done"
            assert await c.rest() == b""
    assert [e["event"] for e in logs if e["event"] == "unhandled_error"] == ["unhandled_error"]
