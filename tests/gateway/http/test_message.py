"""A request's body as it arrives (``gateway.http.message.Body``) and its head (``Request``),
fed by hand, without sockets."""

from __future__ import annotations

import asyncio

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from backends.errors import BodyTooLarge
from gateway.http import Body, Request
from gateway.http.message import HIGH_WATER, LOW_WATER, split_target


class Channel:
    """The connection, as a body sees it: what it was asked to do."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @property
    def transport(self) -> asyncio.Transport | None:
        return None

    def pause_body(self) -> None:
        self.calls.append("pause")

    def resume_body(self) -> None:
        self.calls.append("resume")

    def send_continue(self) -> None:
        self.calls.append("continue")


def request(body: Body, *, headers: dict[str, str] | None = None, limit: int = 100) -> Request:
    return Request(
        method="POST",
        target="/x",
        headers=CIMultiDictProxy(CIMultiDict(headers or {})),
        version=(1, 1),
        content=body,
        max_body_bytes=limit,
    )


async def test_readany_takes_what_came_and_read_n_at_most_n() -> None:
    body = Body()
    body.feed(b"abc")
    body.feed(b"def")
    assert await body.read(2) == b"ab"
    assert await body.readany() == b"cdef"
    body.feed(b"gh")
    body.feed_eof()
    assert body.is_eof()
    assert not body.at_eof()
    assert await body.read() == b"gh"
    assert body.at_eof()
    assert await body.readany() == b""
    assert await body.read(5) == b""


async def test_a_read_waits_for_the_body_to_come() -> None:
    body = Body()
    reading = asyncio.ensure_future(body.read())
    await asyncio.sleep(0)  # sleep-ok: let the read start waiting
    body.feed(b"a")
    body.feed(b"b")
    assert not reading.done()
    body.feed_eof()
    assert await reading == b"ab"


async def test_the_socket_pauses_past_the_high_water_mark_and_resumes_under_the_low() -> None:
    channel = Channel()
    body = Body(channel)
    body.feed(b"x" * HIGH_WATER)
    assert channel.calls == []
    body.feed(b"x")
    assert channel.calls == ["pause"]
    body.feed(b"x" * 10)
    assert channel.calls == ["pause"]
    await body.read(HIGH_WATER - LOW_WATER)  # LOW_WATER + 11 bytes left: still paused
    assert channel.calls == ["pause"]
    await body.read(11)
    assert channel.calls == ["pause", "resume"]


async def test_release_lets_the_socket_be_read_again() -> None:
    channel = Channel()
    body = Body(channel)
    body.feed(b"x" * (HIGH_WATER + 1))
    body.release()
    assert channel.calls == ["pause", "resume"]


async def test_100_continue_is_asked_for_on_the_first_wait_only() -> None:
    channel = Channel()
    body = Body(channel, expect_continue=True)
    reading = asyncio.ensure_future(body.read(3))
    await asyncio.sleep(0)  # sleep-ok: let the read start waiting
    assert channel.calls == ["continue"]
    body.feed(b"abc")
    assert await reading == b"abc"
    reading = asyncio.ensure_future(body.readany())
    await asyncio.sleep(0)  # sleep-ok: let the read start waiting
    body.feed_eof()
    assert await reading == b""
    assert channel.calls == ["continue"]


async def test_no_100_continue_when_the_body_came_anyway() -> None:
    channel = Channel()
    body = Body(channel, expect_continue=True)
    body.feed(b"abc")
    body.feed_eof()
    assert await body.read() == b"abc"
    assert channel.calls == []


async def test_a_client_gone_mid_body_fails_the_read_after_what_came() -> None:
    body = Body()
    body.feed(b"abc")
    body.set_exception(ConnectionResetError("gone"))
    assert await body.readany() == b"abc"
    with pytest.raises(ConnectionResetError):
        await body.readany()


async def test_iter_chunked_yields_pieces_of_at_most_n() -> None:
    body = Body()
    body.feed(b"0123456789")
    body.feed_eof()
    assert [p async for p in body.iter_chunked(4)] == [b"0123", b"4567", b"89"]


async def test_request_read_is_bounded_and_remembered() -> None:
    body = Body()
    body.feed(b"x" * 60)
    body.feed(b"y" * 40)
    body.feed_eof()
    req = request(body, limit=100)
    assert await req.read() == b"x" * 60 + b"y" * 40
    assert await req.read() == b"x" * 60 + b"y" * 40  # read once, kept


async def test_request_read_past_the_limit_is_body_too_large() -> None:
    body = Body()
    body.feed(b"x" * 101)
    body.feed_eof()
    with pytest.raises(BodyTooLarge, match="larger than the limit of 100 bytes"):
        await request(body).read()


async def test_a_declared_length_past_the_limit_fails_before_any_read() -> None:
    channel = Channel()
    body = Body(channel, expect_continue=True)
    req = request(body, headers={"Content-Length": "101"})
    with pytest.raises(BodyTooLarge) as caught:
        await req.read()
    assert caught.value.status == 413
    assert channel.calls == []  # the client was never invited to send it


@pytest.mark.parametrize(
    ("target", "path", "query"),
    [
        ("/v1/x", "/v1/x", ""),
        ("/v1/a%20b?q=1&r=%20", "/v1/a b", "q=1&r=%20"),
        ("/a#frag", "/a", ""),
        ("/a?b#frag", "/a", "b"),
        ("*", "*", ""),
        ("http://host:8/p?q=1", "/p", "q=1"),
        ("http://host", "/", ""),
    ],
)
def test_a_target_splits_into_its_decoded_path_and_query(
    target: str, path: str, query: str
) -> None:
    assert split_target(target) == (path, query)
