"""Hostile and malformed HTTP: each request below is refused by the server itself (the status
given, ``Connection: close``, the error body with the status's code) or the connection just
ends; the handler is never called, nothing stays open, and each refusal is exactly one
``http_refused`` log line, never a traceback. A flood of them is sampled."""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping, Sequence
from typing import Any

import pytest
import structlog

from gateway.http import LogSampler, Request, Response
from tests.gateway.http.rig import RawClient, Served, one_route, serving
from tests.waiting import wait_for

MAX_HEADER = 1024  # the corpus' max_header_bytes: the whole head may be 4 KiB
CLOSED = "closed"

POST = b"POST /x HTTP/1.1\r\n"
CL = b"Content-Length: 3\r\n"
TE = b"Transfer-Encoding: chunked\r\n"
CHUNKED = POST + TE + b"\r\n"  # a chunked body follows
GET = b"GET /x HTTP/1.1\r\n"
CASES: list[tuple[str, bytes, int | str]] = [
    # framing of the body
    ("cl_then_te", POST + CL + TE + b"\r\n0\r\n\r\n", 400),
    ("te_then_cl", POST + TE + CL + b"\r\n0\r\n\r\n", 400),
    ("duplicate_cl", POST + CL + CL + b"\r\nabc", 400),
    ("differing_cl", POST + CL + b"Content-Length: 4\r\n\r\nabcd", 400),
    ("cl_list", POST + b"Content-Length: 3, 3\r\n\r\nabc", 400),
    ("negative_cl", POST + b"Content-Length: -1\r\n\r\n", 400),
    ("signed_cl", POST + b"Content-Length: +3\r\n\r\nabc", 400),
    ("non_numeric_cl", POST + b"Content-Length: abc\r\n\r\n", 400),
    ("overflowing_cl", POST + b"Content-Length: 99999999999999999999999\r\n\r\n", 400),
    ("bad_chunk_size", CHUNKED + b"zz\r\nabc\r\n0\r\n\r\n", 400),
    ("negative_chunk_size", CHUNKED + b"-3\r\nabc\r\n0\r\n\r\n", 400),
    ("overflowing_chunk_size", CHUNKED + b"fffffffffffffffffff\r\nabc\r\n", 400),
    ("chunk_longer_than_said", CHUNKED + b"3\r\nabcX0\r\n\r\n", 400),
    ("te_not_chunked", POST + b"Transfer-Encoding: gzip\r\n\r\nabc", 400),
    ("te_chunked_not_last", POST + b"Transfer-Encoding: chunked, gzip\r\n\r\nabc", 400),
    ("te_lookalike", POST + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n", 400),
    # line endings and header syntax
    ("obs_fold_space", GET + b"X-A: a\r\n b\r\nHost: t\r\n\r\n", 400),
    ("obs_fold_tab", GET + b"X-A: a\r\n\tb\r\n\r\n", 400),
    ("space_before_first_header", GET + b" X-A: a\r\n\r\n", 400),
    ("bare_lf", b"GET /x HTTP/1.1\nHost: t\n\n", 400),
    ("bare_lf_after_header", GET + b"Host: t\n\r\n", 400),
    ("bare_cr", b"GET /x HTTP/1.1\rHost: t\r\n\r\n", 400),
    ("space_before_colon", GET + b"X-A : a\r\n\r\n", 400),
    ("empty_header_name", GET + b": a\r\n\r\n", 400),
    ("bad_header_name", GET + b"X(y): a\r\n\r\n", 400),
    ("nul_in_value", GET + b"X-A: a\x00b\r\n\r\n", 400),
    ("control_in_value", GET + b"X-A: a\x01b\r\n\r\n", 400),
    # the request line
    ("invalid_method", b"G@T /x HTTP/1.1\r\n\r\n", 400),
    ("unknown_method", b"FOO /x HTTP/1.1\r\n\r\n", 400),
    ("invalid_version", b"GET /x HTTP/9.9\r\n\r\n", 400),
    ("not_http", b"GET /x HTTX/1.1\r\n\r\n", 400),
    ("http_2_0_over_h1", b"GET /x HTTP/2.0\r\n\r\n", 505),
    ("http_0_9", b"GET /x\r\n\r\n", 505),
    ("space_in_target", b"GET /a b HTTP/1.1\r\n\r\n", 400),
    ("control_in_target", b"GET /a\x01b HTTP/1.1\r\n\r\n", 400),
    ("binary_garbage", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400),
    # sizes
    ("target_too_long", b"GET /" + b"a" * (MAX_HEADER + 1) + b" HTTP/1.1\r\n\r\n", 414),
    ("header_field_too_long", GET + b"X-A: " + b"a" * MAX_HEADER + b"\r\n\r\n", 431),
    ("too_many_headers", GET + b"X-A: a\r\n" * 101 + b"\r\n", 431),
    ("head_too_large", GET + b"X-A: %s\r\n" % (b"a" * 90) * 50 + b"\r\n", 431),
    ("head_never_ending", GET + b"X-A: " + b"a" * (5 * MAX_HEADER), 431),
    # expectations
    ("unknown_expectation", POST + b"Expect: 200-ok\r\nContent-Length: 1\r\n\r\nx", 417),
    # not a refusal: the client stops half-way and goes
    ("head_then_gone", GET + b"Host: t", CLOSED),
]
# The error body's code of each refusal: its status's name, like the gateway's other codes
CODES = {
    400: "malformed_http_request",
    408: "request_timeout",
    414: "uri_too_long",
    417: "expectation_failed",
    431: "request_header_fields_too_large",
    505: "http_version_not_supported",
}


class Called:
    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, request: Request) -> Response:
        self.paths.append(request.path)
        return Response(body=b"handled")


def refusals(logs: Sequence[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == "http_refused"]


def no_traceback(logs: Sequence[MutableMapping[str, Any]]) -> bool:
    return not any("exc_info" in e or "exception" in e for e in logs)


async def _ends(served: Served) -> None:
    await wait_for(lambda: served.open_connections() == 0, what="no connection left open")


@pytest.mark.parametrize(("raw", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_a_hostile_request_is_refused_and_nothing_stays_held(
    raw: bytes, expected: int | str
) -> None:
    handler = Called()
    with structlog.testing.capture_logs() as logs:
        async with (
            serving(one_route(handler), max_header_bytes=MAX_HEADER) as srv,
            await RawClient.open(srv.port) as c,
        ):
            await c.send(raw)
            if expected == CLOSED:
                assert c.writer.can_write_eof()
                c.writer.write_eof()
                assert await c.rest() == b""
            else:
                reply = await c.reply()
                assert reply.status == expected
                assert reply.headers["Connection"] == "close"
                assert reply.headers["Content-Type"] == "application/json"
                error = json.loads(reply.body)["error"]
                assert error["type"] == ("invalid_request_error")
                assert error["code"] == CODES[expected]
                assert error["message"]
                assert await c.rest() == b""
            await _ends(srv)
    assert handler.paths == []
    lines = refusals(logs)
    if expected == CLOSED:
        assert lines == []
    else:
        assert len(lines) == 1
        assert lines[0]["status"] == expected
        assert lines[0]["reason"] == error["message"]
        assert lines[0]["peer"].startswith("127.0.0.1:")
        assert "suppressed" not in lines[0]
    assert no_traceback(logs)


async def test_a_refused_request_behind_good_ones_is_answered_in_its_turn() -> None:
    handler = Called()
    with structlog.testing.capture_logs() as logs:
        async with serving(one_route(handler)) as srv, await RawClient.open(srv.port) as c:
            await c.send(
                b"GET /x HTTP/1.1\r\n\r\nGET /x HTTP/1.1\r\n\r\nGET /x HTTP/1.1\r\nX: a\x00\r\n\r\n"
            )
            statuses = [(await c.reply()).status for _ in range(3)]
            assert statuses == [200, 200, 400]
            assert await c.rest() == b""
            await _ends(srv)
    assert handler.paths == ["/x", "/x"]
    assert len(refusals(logs)) == 1


async def test_a_refused_request_gets_the_error_body_of_its_endpoint() -> None:
    def anthropic(status: int, message: str, path: str | None) -> bytes:
        return json.dumps({"type": "error", "path": path, "status": status}).encode()

    async with (
        serving(one_route(Called()), error_body=anthropic) as srv,
        await RawClient.open(srv.port) as c,
    ):
        await c.send(b"POST /v1/messages HTTP/1.1\r\nContent-Length: x\r\n\r\n")
        reply = await c.reply()
    assert json.loads(reply.body) == {"type": "error", "path": "/v1/messages", "status": 400}


async def test_a_slowloris_head_is_refused_408_after_header_timeout() -> None:
    handler = Called()
    head = GET + b"X-Slow: 1\r\nX-More: " + b"a" * 200

    with structlog.testing.capture_logs() as logs:
        async with (
            serving(one_route(handler), header_timeout=0.1) as srv,
            await RawClient.open(srv.port) as c,
        ):

            async def trickle() -> None:
                for i in range(len(head)):
                    await c.send(head[i : i + 1])
                    await asyncio.sleep(0.005)  # sleep-ok: the slow client's pace

            sender = asyncio.create_task(trickle())
            try:
                reply = await c.reply()
            finally:
                sender.cancel()
            assert reply.status == 408
            assert reply.headers["Connection"] == "close"
            assert json.loads(reply.body)["error"]["code"] == CODES[408]
            assert await c.rest() == b""
            await _ends(srv)
    assert handler.paths == []
    assert [line["status"] for line in refusals(logs)] == [408]
    assert no_traceback(logs)


async def test_a_head_that_comes_in_one_piece_is_not_timed() -> None:
    """A complete head never meets the header timeout, however short (no timer is armed)."""
    handler = Called()
    async with (
        serving(one_route(handler), header_timeout=0.001) as srv,
        await RawClient.open(srv.port) as c,
    ):
        for _ in range(3):
            await c.send(b"GET /x HTTP/1.1\r\n\r\n")
            assert (await c.reply()).status == 200


class FrozenClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_flood_of_refusals_is_logged_sampled_with_a_count_of_the_rest() -> None:
    clock = FrozenClock()
    sampler = LogSampler(rate=10, per=1.0, clock=clock)
    handler = Called()
    flood = 200

    async def one_bad_request(port: int) -> int:
        async with await RawClient.open(port) as c:
            await c.send(b"GET /x HTTP/1.1\r\nContent-Length: nope\r\n\r\n")
            return (await c.reply()).status

    with structlog.testing.capture_logs() as logs:
        async with serving(one_route(handler), sampler=sampler) as srv:
            for start in range(0, flood, 50):
                batch = [one_bad_request(srv.port) for _ in range(start, start + 50)]
                assert set(await asyncio.gather(*batch)) == {400}
            assert len(refusals(logs)) == 10  # the burst; the rest counted
            clock.now += 1.0
            assert await one_bad_request(srv.port) == 400
            await _ends(srv)
    lines = refusals(logs)
    assert len(lines) == 11
    assert all("suppressed" not in line for line in lines[:10])
    assert lines[10]["suppressed"] == flood - 10
    assert handler.paths == []
    assert no_traceback(logs)
