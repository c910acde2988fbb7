"""The tap on an upstream body: every read reaches the sink in order, then the end or the error.

The upstream is a raw asyncio server, so each test controls the exact bytes and their split
across TCP writes (aiohttp's own parser decodes the framing; the tap must lose nothing
whatever state that parser is in when the tap goes in).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import aiohttp
import pytest
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader

from backends.tap import Tap, internals_problem, tap
from tests.helpers import wait_for

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [b"data: one\n\n", b"data: two\n\n", b"data: three\n\n", b"data: [DONE]\n\n"]
BODY = b"".join(EVENTS)
RAW = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"


@dataclass
class Sink:
    data: list[bytes] = field(default_factory=list)
    ended: bool = False
    error: BaseException | None = None
    pause_after: int | None = None  # ask to stop reading after this many reads

    def on_data(self, data: bytes) -> bool:
        self.data.append(data)
        return self.pause_after is not None and len(self.data) >= self.pause_after

    def on_end(self) -> None:
        self.ended = True

    def on_error(self, exc: BaseException) -> None:
        self.error = exc

    @property
    def done(self) -> bool:
        return self.ended or self.error is not None


def more_than(sink: Sink, reads: int) -> bool:
    return len(sink.data) > reads or sink.done


@dataclass
class RawUpstream:
    """Answers each request with ``HEAD + first`` at once, then ``rest`` once ``go`` is set."""

    first: bytes = b""
    rest: bytes = b""
    go: asyncio.Event = field(default_factory=asyncio.Event)
    then_close: bool = False  # close the connection after ``rest``
    peers: list[object] = field(default_factory=list)
    url: str = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                self.peers.append(writer.get_extra_info("peername"))
                writer.write(HEAD + self.first)
                await writer.drain()
                await self.go.wait()
                writer.write(self.rest)
                await writer.drain()
                if self.then_close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the test is over
        finally:
            writer.close()


@asynccontextmanager
async def raw_upstream(up: RawUpstream) -> AsyncIterator[RawUpstream]:
    server = await asyncio.start_server(up.handle, "127.0.0.1", 0)
    up.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
    try:
        yield up
    finally:
        server.close()


@asynccontextmanager
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        yield s


@asynccontextmanager
async def tapped(
    s: aiohttp.ClientSession, up: RawUpstream, sink: Sink
) -> AsyncIterator[tuple[Tap, aiohttp.ClientResponse]]:
    """A request whose body is tapped; closed at the end unless it completed."""
    resp = await s.post(up.url, data=b"{}")
    t = tap(resp, sink)
    assert t is not None
    try:
        yield t, resp
    finally:
        t.close()
        if sink.ended:
            resp.release()
        else:
            resp.close()


@pytest.mark.parametrize("split", range(len(RAW)))
async def test_every_split_of_the_body_reaches_the_sink_whole_and_in_order(split: int) -> None:
    """Whatever aiohttp had parsed (mid-size line, mid-data, mid-CRLF) when the tap went in."""
    up = RawUpstream(first=RAW[:split], rest=RAW[split:])
    sink = Sink()
    async with raw_upstream(up), session() as s, tapped(s, up, sink):
        up.go.set()
        await wait_for(lambda: sink.done, what="end of body")
    assert sink.error is None
    assert b"".join(sink.data) == BODY


async def test_each_read_is_delivered_as_it_arrives() -> None:
    up = RawUpstream(first=RAW[:16], rest=RAW[16:])
    sink = Sink()
    async with raw_upstream(up), session() as s, tapped(s, up, sink) as (t, resp):
        await wait_for(lambda: sink.data == [b"data: one\n\n"], what="the first event")
        assert not sink.done
        up.go.set()
        await wait_for(lambda: sink.done, what="end of body")
        t.close()
        assert type(resp.content) is StreamReader  # switched back


async def test_a_completed_tapped_response_goes_back_to_the_keepalive_pool() -> None:
    up = RawUpstream(first=RAW[:20], rest=RAW[20:])
    async with raw_upstream(up), session() as s:
        for _ in range(3):
            sink = Sink()
            up.go.clear()
            async with tapped(s, up, sink):
                up.go.set()
                await wait_for(partial(more_than, sink, 10**9), what="end of body")
            assert sink.ended
        assert len(set(up.peers)) == 1, up.peers


async def test_a_lie_in_the_chunk_framing_is_an_error_and_closes_the_connection() -> None:
    up = RawUpstream(first=RAW[:16], rest=b"zz\r\nhello\r\n")
    sink = Sink()
    async with raw_upstream(up), session() as s, tapped(s, up, sink) as (_, resp):
        transport = resp.connection.transport if resp.connection else None
        assert transport is not None
        up.go.set()
        await wait_for(lambda: sink.done, what="the error")
        assert isinstance(sink.error, HttpProcessingError)
        assert b"".join(sink.data) == b"data: one\n\n"
        assert transport.is_closing()


async def test_a_connection_lost_mid_body_is_an_error() -> None:
    up = RawUpstream(first=RAW[:16], then_close=True)
    sink = Sink()
    async with raw_upstream(up), session() as s, tapped(s, up, sink):
        up.go.set()  # the server writes nothing more and closes
        await wait_for(lambda: sink.done, what="the error")
        assert isinstance(sink.error, aiohttp.ClientPayloadError)


async def test_an_error_set_on_the_body_from_outside_reaches_the_sink() -> None:
    """As the idle watchdog does."""
    up = RawUpstream(first=RAW[:16])
    sink = Sink()
    async with raw_upstream(up), session() as s, tapped(s, up, sink) as (_, resp):
        resp.content.set_exception(aiohttp.SocketTimeoutError("idle"))
        assert isinstance(sink.error, aiohttp.SocketTimeoutError)
        up.go.set()


async def test_a_sink_that_asks_to_stop_stops_the_transport_until_resume() -> None:
    up = RawUpstream(first=RAW[:16], rest=RAW[16:])
    sink = Sink(pause_after=1)
    async with raw_upstream(up), session() as s, tapped(s, up, sink) as (t, resp):
        transport = resp.connection.transport if resp.connection else None
        assert transport is not None
        await wait_for(partial(more_than, sink, 0), what="the first read")
        assert t.paused
        assert not transport.is_reading()
        up.go.set()
        t.resume()
        assert transport.is_reading()
        await wait_for(lambda: sink.done, what="end of body")
    assert b"".join(sink.data) == BODY


async def test_the_chunks_of_one_read_reach_the_sink_as_one_piece() -> None:
    up = RawUpstream(first=RAW[:16], rest=RAW[16:])  # the rest: three chunks and the end
    sink = Sink()
    async with raw_upstream(up), session() as s, tapped(s, up, sink):
        await wait_for(partial(more_than, sink, 0), what="the first read")
        up.go.set()
        await wait_for(lambda: sink.done, what="end of body")
    assert sink.data[0] == EVENTS[0]
    assert b"".join(sink.data[1:]) == b"".join(EVENTS[1:])
    assert len(sink.data) <= 3  # not one piece per chunk (a read may split in TCP, rarely)


async def test_a_body_that_already_ended_is_not_tapped() -> None:
    up = RawUpstream(first=RAW)
    async with raw_upstream(up), session() as s:
        resp = await s.post(up.url, data=b"{}")
        await wait_for(resp.content.is_eof, what="the whole body")
        assert tap(resp, Sink()) is None
        assert await resp.read() == BODY
        up.go.set()


def test_the_internals_the_tap_relies_on_are_as_it_expects() -> None:
    """On the pinned aiohttp (pyproject.toml) the start-up check finds nothing amiss."""
    assert internals_problem() is None


def test_a_changed_internal_is_named() -> None:
    class Reader(StreamReader):
        __slots__ = ()

        def feed_data(self, data: bytes) -> bool:  # type: ignore[override]
            return False

    class Plain:
        def feed_data(self, data: bytes, size: int = 0) -> bool:
            return False

    assert internals_problem(reader=Reader) == (
        "Reader.feed_data takes ('self', 'data'), the tap expects ('self', 'data', 'size')"
    )
    assert internals_problem(reader=Plain) == "Plain.feed_eof is missing"
