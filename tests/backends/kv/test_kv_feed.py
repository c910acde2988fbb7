"""The KV-event feed against a real ZMQ publisher on 127.0.0.1 speaking vLLM's wire format:
discovery, sync from the replay socket, gap repair, a restarted publisher, a dead one, a
backend marked down, one without events, and events it cannot read."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from backends.kv.feed import KvFeeds
from backends.kv.sources import FeedSettings, FeedStatus, parse_sources, reach
from backends.pool import BackendPool
from backends.state import BackendSpec
from backends.upstream.mock import MockRequest, MockResponse, MockTransport
from policies.kv_index import KvIndex, chain_keys
from tests.waiting import wait_for

BS = 4
END = (-1).to_bytes(8, "big", signed=True)


class Publisher:
    """vLLM's ZmqEventPublisher in miniature: PUB, a ROUTER replay socket, a replay buffer."""

    def __init__(self, ctx: zmq.asyncio.Context, *, replay: bool = True) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER) if replay else None
        self.replay_port = None
        if self.router is not None:
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self._serving = asyncio.create_task(self._serve()) if self.router is not None else None

    def sources(self) -> dict[str, Any]:
        return {
            "0": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.port}",
                "replay_endpoint": None
                if self.replay_port is None
                else f"tcp://*:{self.replay_port}",
                "topic": "",
            }
        }

    def encode(self, events: list[Any]) -> bytes:
        return msgspec.msgpack.encode([time.time(), events, 0])

    async def publish(self, events: list[Any], *, send: bool = True) -> None:
        payload = self.encode(events)
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            client, _empty, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.router.send_multipart(
                        [client, b"", b"", seq.to_bytes(8, "big"), payload]
                    )
            await self.router.send_multipart([client, b"", b"", END, b""])

    async def close(self) -> None:
        if self._serving is not None:
            self._serving.cancel()
            await asyncio.gather(self._serving, return_exceptions=True)
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


def stored(tokens: Sequence[int], parent: Any = None, first: int = 0) -> dict[str, Any]:
    n = len(tokens) // BS
    return {
        "type": "BlockStored",
        "block_hashes": [1000 + first + i for i in range(n)],
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
    }


PROMPT = list(range(1, 17))  # four blocks of four


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def following(
    publisher: Publisher | None, answer: dict[str, Any] | None = None, **settings: Any
) -> tuple[KvFeeds, KvIndex, BackendPool]:
    doc = answer if answer is not None else (publisher.sources() if publisher else {})

    async def backend(request: MockRequest) -> MockResponse:
        assert request.path == "/kv_event_sources"
        return MockResponse.json(doc)

    pool = BackendPool([BackendSpec("b0", "http://127.0.0.1:9")], stale_after=5.0)
    pool.record_probe("b0", True, "")
    index = KvIndex()
    feeds = KvFeeds(
        pool,
        index,
        MockTransport(backend),
        FeedSettings(poll_interval=0.02, replay_timeout=1.0, silent_warning_s=0.5, **settings),
    )
    await feeds.start()
    return feeds, index, pool


def state(feeds: KvFeeds) -> str | None:
    st = feeds.status.get("b0")
    return None if st is None else st.state


def held(index: KvIndex, tokens: Sequence[int] = PROMPT) -> int:
    return index.match(chain_keys(tokens, BS), ["b0"])["b0"]


async def test_events_published_before_the_gateway_came_are_replayed_then_followed_live(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = Publisher(ctx)
    await pub.publish([stored(PROMPT[:8])], send=False)  # before anyone subscribed
    feeds, index, _ = await following(pub)
    try:
        await wait_for(lambda: index.exact("b0"), within=5.0, what="the feed live")
        assert held(index) == 2  # from the replay
        await wait_for(lambda: feeds.status["b0"].state == "live", within=2.0, what="live")
        await pub.publish([stored(PROMPT[8:], parent=1001, first=2)])
        await wait_for(lambda: held(index) == 4, within=5.0, what="the live store applied")
        await pub.publish([{"type": "BlockRemoved", "block_hashes": [1003], "medium": "GPU"}])
        await wait_for(lambda: held(index) == 3, within=5.0, what="the removal applied")
        assert feeds.status["b0"].form == "tagged"
    finally:
        await feeds.stop()
        await pub.close()


async def test_a_gap_is_repaired_from_the_replay_socket(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    feeds, index, _ = await following(pub)
    try:
        await wait_for(lambda: index.exact("b0"), within=5.0, what="the feed live")
        await pub.publish([stored(PROMPT[:4])])
        await wait_for(lambda: held(index) == 1, within=5.0, what="the first block")
        await pub.publish([stored(PROMPT[4:8], parent=1000, first=1)], send=False)  # lost
        await pub.publish([stored(PROMPT[8:12], parent=1001, first=2)])
        await wait_for(lambda: held(index) == 3, within=5.0, what="the gap repaired")
        assert feeds.status["b0"].gaps["replayed"] == 1
        assert feeds.status["b0"].gaps["lost"] == 0
    finally:
        await feeds.stop()
        await pub.close()


async def test_a_gap_without_replay_clears_the_backend(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx, replay=False)
    feeds, index, _ = await following(pub)
    try:
        await wait_for(lambda: index.exact("b0"), within=5.0, what="the feed live")
        # The SUB socket may join after the first sends (ZMQ's slow joiner): send until seen.
        deadline = time.monotonic() + 5
        while held(index) < 1:
            assert time.monotonic() < deadline
            await pub.publish([stored(PROMPT[:4])])
            await asyncio.sleep(0.05)  # sleep-ok: resend pace while the subscription joins
        await pub.publish([{"type": "BlockRemoved", "block_hashes": [1000]}], send=False)
        await pub.publish([stored([9, 9, 9, 9], first=50)])
        await wait_for(
            lambda: feeds.status["b0"].gaps["lost"] == 1, within=5.0, what="the gap seen"
        )
        assert held(index) == 0  # nothing claimed that the engine may have dropped
        assert held(index, [9, 9, 9, 9, 0]) == 1  # what came after the gap is kept
    finally:
        await feeds.stop()
        await pub.close()


async def test_a_restarted_publisher_clears_what_the_old_engine_held(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = Publisher(ctx)
    feeds, index, _ = await following(pub)
    try:
        await wait_for(lambda: index.exact("b0"), within=5.0, what="the feed live")
        for _ in range(3):
            await pub.publish([stored(PROMPT)])
        await wait_for(lambda: held(index) == 4, within=5.0, what="the prompt cached")
        port, replay_port = pub.port, pub.replay_port
        await pub.close()
        await wait_for(lambda: not index.exact("b0"), within=5.0, what="the dead publisher noticed")
        assert feeds.status["b0"].state == "disconnected"
        # The engine comes back on the same ports with an empty cache and a new sequence.
        again = Publisher.__new__(Publisher)
        again.pub = ctx.socket(zmq.PUB)
        again.pub.setsockopt(zmq.LINGER, 0)
        again.pub.bind(f"tcp://127.0.0.1:{port}")
        again.router = ctx.socket(zmq.ROUTER)
        again.router.setsockopt(zmq.LINGER, 0)
        again.router.bind(f"tcp://127.0.0.1:{replay_port}")
        again.port, again.replay_port, again.seq, again.buffer = port, replay_port, 0, []
        again._serving = asyncio.create_task(again._serve())
        await again.publish([stored([7, 7, 7, 7, 7], first=90)], send=False)
        try:
            await wait_for(lambda: index.exact("b0"), within=10.0, what="live again")
            await wait_for(lambda: held(index, [7, 7, 7, 7, 7]) == 1, within=5.0, what="new events")
            assert held(index) == 0  # the old engine's blocks are gone
            assert feeds.status["b0"].gaps["restart"] == 1
        finally:
            await again.close()
    finally:
        await feeds.stop()


async def test_a_backend_marked_down_is_cleared(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    await pub.publish([stored(PROMPT)], send=False)
    feeds, index, pool = await following(pub)
    try:
        await wait_for(lambda: held(index) == 4, within=5.0, what="the replayed prompt")
        for _ in range(5):  # past the health policy's fall count
            pool.record_probe("b0", False, "refused")
        await wait_for(lambda: held(index) == 0, within=5.0, what="the index cleared")
    finally:
        await feeds.stop()
        await pub.close()


async def test_a_backend_without_events_is_never_live_and_says_why(
    ctx: zmq.asyncio.Context,
) -> None:
    feeds, index, _ = await following(None, answer={})
    try:
        await wait_for(lambda: state(feeds) == "off", within=5.0, what="off")
        assert "--kv-events-config" in feeds.status["b0"].why
        assert not index.exact("b0")
    finally:
        await feeds.stop()


async def test_no_publisher_listening_is_reported_not_silent(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    answer = pub.sources()
    await pub.close()  # configured, but nothing listens on the port
    feeds, index, _ = await following(None, answer=answer)
    try:
        await wait_for(
            lambda: "no publisher answering" in (feeds.status.get("b0") or FeedStatus()).why,
            within=5.0,
            what="the warning",
        )
        assert not index.exact("b0")
    finally:
        await feeds.stop()


async def test_events_it_cannot_read_make_the_backend_undecodable(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = Publisher(ctx)
    feeds, index, _ = await following(pub)
    try:
        await wait_for(lambda: index.exact("b0"), within=5.0, what="the feed live")
        deadline = time.monotonic() + 5
        while feeds.status["b0"].state != "undecodable":
            assert time.monotonic() < deadline
            await pub.pub.send_multipart([b"", pub.seq.to_bytes(8, "big"), b"\xc1garbage"])
            pub.seq += 1
            await asyncio.sleep(0.05)  # sleep-ok: resend pace while the subscription joins
        assert not index.exact("b0")
        assert feeds.status["b0"].problems["undecodable"] >= 1
    finally:
        await feeds.stop()
        await pub.close()


def test_wildcard_endpoints_are_reached_at_the_backends_host() -> None:
    assert reach("tcp://*:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert reach("tcp://0.0.0.0:5557", "http://gpu-3.local:8000") == "tcp://gpu-3.local:5557"
    assert reach("tcp://10.1.1.1:5557", "http://x:8000") == "tcp://10.1.1.1:5557"
    assert reach("ipc:///tmp/kv", "http://x:8000") == "ipc:///tmp/kv"


def test_sources_name_each_rank_and_say_why_when_there_are_none() -> None:
    doc = {
        "0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"},
        "1": {"enable_kv_cache_events": True, "endpoint": "tcp://*:5558", "topic": "kv"},
    }
    found = parse_sources(doc, "http://10.0.0.7:8000")
    assert not isinstance(found, str)
    assert [(s.rank, s.endpoint, s.topic) for s in found] == [
        (0, "tcp://10.0.0.7:5557", ""),
        (1, "tcp://10.0.0.7:5558", "kv"),
    ]
    assert "--kv-events-config" in str(parse_sources({}, "http://x:8000"))
    assert "not zmq" in str(parse_sources({"0": {**doc["0"], "publisher": "null2"}}, "http://x"))
