"""Answers as bytes (``gateway.http.response``), written to a writer that records them."""

from __future__ import annotations

import asyncio
import json

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.http import Body, Request, Response, StreamResponse, json_response


class Writer:
    """The connection, as a response sees it: the head sealed plainly, writes recorded."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.finished_with: list[Request] = []
        self.closes: list[bool] = []
        self.writing_paused = False

    @property
    def transport(self) -> asyncio.Transport | None:
        return None

    def seal_head(self, request: Request, head: bytes, *, close: bool, date: bool) -> bytes:
        self.closes.append(close)
        return head + b"\r\n"

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def finished(self, request: Request) -> None:
        self.finished_with.append(request)

    async def drain(self) -> None:
        self.writing_paused = False

    def pause_body(self) -> None: ...

    def resume_body(self) -> None: ...

    def send_continue(self) -> None: ...


def on(writer: Writer, method: str = "GET", version: tuple[int, int] = (1, 1)) -> Request:
    body = Body()
    body.feed_eof()
    return Request(
        method=method,
        target="/x",
        headers=CIMultiDictProxy(CIMultiDict()),
        version=version,
        content=body,
        channel=writer,
    )


async def test_a_response_is_one_write_with_its_length() -> None:
    w = Writer()
    req = on(w)
    resp = Response(body=b"hello", content_type="text/plain", headers={"X-A": "1"})
    assert not resp.prepared
    await resp.prepare(req)
    assert resp.prepared
    assert w.sent == []
    await resp.write_eof()
    await resp.write_eof()  # once only
    assert w.sent == [
        b"HTTP/1.1 200 OK\r\nX-A: 1\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello"
    ]
    assert w.finished_with == [req]


async def test_json_response_is_compact_json() -> None:
    resp = json_response({"a": [1, 2]}, status=201, headers={"X-B": "2"})
    assert (resp.status, resp.body) == (201, b'{"a":[1,2]}')
    assert resp.headers["Content-Type"] == "application/json"
    assert json.loads(resp.body) == {"a": [1, 2]}


async def test_a_stream_holds_its_head_for_its_first_chunk() -> None:
    w = Writer()
    resp = StreamResponse(status=201, reason="Made", headers={"Content-Type": "text/event-stream"})
    await resp.prepare(on(w))
    assert resp.chunked
    assert w.sent == []
    await resp.write(b"")  # nothing to send: the head waits still
    assert w.sent == []
    await resp.write(b"abc")
    await resp.write(b"de")
    await resp.write_eof(b"f")
    assert w.sent == [
        b"HTTP/1.1 201 Made\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked"
        b"\r\n\r\n3\r\nabc\r\n",
        b"2\r\nde\r\n",
        b"1\r\nf\r\n0\r\n\r\n",
    ]
    with pytest.raises(RuntimeError):
        await resp.write(b"late")


async def test_flush_head_sends_the_head_alone() -> None:
    w = Writer()
    resp = StreamResponse()
    resp.content_length = 3
    assert resp.content_length == 3
    await resp.prepare(on(w))
    assert not resp.chunked
    resp.flush_head()
    resp.flush_head()
    assert len(w.sent) == 1
    assert w.sent[0].startswith(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n")
    await resp.write(b"abc")
    await resp.write_eof()
    assert w.sent[1:] == [b"abc"]


async def test_a_write_to_a_full_transport_drains() -> None:
    w = Writer()
    resp = StreamResponse()
    await resp.prepare(on(w))
    w.writing_paused = True
    assert resp.writing_paused
    await resp.write(b"x")
    assert not w.writing_paused


async def test_head_gets_the_head_alone_with_the_length_it_would_have() -> None:
    w = Writer()
    resp = Response(body=b"hello")
    await resp.prepare(on(w, "HEAD"))
    await resp.write_eof()
    assert w.sent == [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"]


async def test_204_and_304_have_no_body_and_no_length() -> None:
    w = Writer()
    for status in (204, 304):
        resp = Response(status=status, body=b"ignored")
        await resp.prepare(on(w))
        await resp.write_eof()
    assert w.sent == [b"HTTP/1.1 204 No Content\r\n\r\n", b"HTTP/1.1 304 Not Modified\r\n\r\n"]


async def test_a_handler_may_ask_to_close_the_connection() -> None:
    w = Writer()
    resp = Response(headers={"Connection": "close"})
    await resp.prepare(on(w))
    assert w.closes == [True]
    assert "Connection" not in resp.headers  # the connection writes its own


async def test_an_http_1_0_stream_is_not_chunked_and_closes() -> None:
    w = Writer()
    resp = StreamResponse()
    await resp.prepare(on(w, version=(1, 0)))
    assert not resp.chunked
    assert w.closes == [True]


async def test_a_line_break_in_a_header_value_is_refused() -> None:
    resp = Response(headers={"X-A": "a\r\nSet-Cookie: evil"})
    with pytest.raises(ValueError, match="line break"):
        await resp.prepare(on(Writer()))


async def test_a_response_is_written_whole() -> None:
    resp = Response(body=b"x")
    await resp.prepare(on(Writer()))
    with pytest.raises(RuntimeError, match="whole"):
        await resp.write(b"more")


async def test_content_type_is_settable() -> None:
    resp = StreamResponse()
    assert resp.content_type is None
    resp.content_type = "text/event-stream"
    assert resp.headers["Content-Type"] == "text/event-stream"
    resp.content_type = None
    assert "Content-Type" not in resp.headers
