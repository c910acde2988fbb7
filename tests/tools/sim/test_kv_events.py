"""KV-cache events: the simulator publishes its prefix-cache changes as vLLM 0.32 does.

Every check on the wire decodes with plain ``msgspec.msgpack.decode`` (never with the
simulator's structs), so it tests the wire form itself: ``[ts, events, rank]`` batches on
``(topic, seq, payload)`` messages, events as tagged maps (or positional arrays), the
ROUTER replay and its end marker. Subscribers wait for the publisher to have seen their
subscription (``subscriptions``) before anything is published, so no batch is lost to ZMQ's
slow-joiner gap and no test sleeps.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.tokenizer.words import tokenize
from tests.waiting import wait_for
from tools.sim import FAST, RunningSim, SimConfig, running_sim
from tools.sim.cli import add_arguments, config_from_args, run
from tools.sim.engine import Engine, Request
from tools.sim.kvcache import BlockPool, CacheCleared, CacheRemoved, CacheStored
from tools.sim.kvevents import KvEventsConfig, block_hashes
from tools.sim.tokens import OutputText

from .conftest import completion_body

BS = FAST.block_size
END = (-1).to_bytes(8, "big", signed=True)
U64 = (1 << 64) - 1
ON = KvEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
STREAM: dict[str, Any] = {"max_tokens": 300, "ignore_eos": True, "stream": True}


def events_on(config: SimConfig = FAST, **kv: Any) -> SimConfig:
    """``config`` with events on (127.0.0.1, free ports, a replay socket) and ``kv`` changes."""
    return config.replace(kv_events=msgspec.structs.replace(ON, **kv))


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def complete(
    client: aiohttp.ClientSession, sim: RunningSim, prompt: str, **extra: Any
) -> dict[str, Any]:
    body = completion_body(prompt, **{"max_tokens": 1, **extra})
    async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        doc: dict[str, Any] = await resp.json()
        return doc


class Message(msgspec.Struct):
    """One message as received, its payload decoded with plain msgpack."""

    topic: bytes
    seq: int
    ts: float
    events: list[Any]
    rank: int | None


def message(topic: bytes, seq: bytes, payload: bytes) -> Message:
    assert len(seq) == 8
    doc = msgspec.msgpack.decode(payload)
    assert isinstance(doc, list)
    assert len(doc) == 3, doc  # [ts, events, data_parallel_rank]
    ts, events, rank = doc
    assert isinstance(ts, float)
    assert isinstance(events, list)
    assert events, "a batch is only sent when it has events"
    return Message(topic, int.from_bytes(seq, "big"), ts, events, rank)


class Subscriber:
    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock

    async def next(self, within: float = 5.0) -> Message:
        async with asyncio.timeout(within):
            frames = await self.sock.recv_multipart()
        assert len(frames) == 3, frames
        return message(*frames)

    async def until(self, count: int, within: float = 5.0) -> list[Message]:
        return [await self.next(within) for _ in range(count)]


@asynccontextmanager
async def subscribed(sim: RunningSim, topic: bytes = b"") -> AsyncIterator[Subscriber]:
    """A SUB socket on the simulator's endpoint, joined (the publisher has its subscription)."""
    endpoint = sim.kv_events.endpoint
    assert endpoint is not None
    assert endpoint.startswith("tcp://127.0.0.1:")
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.SUBSCRIBE, topic)
        before = sim.kv_events.subscriptions
        sock.connect(endpoint)
        await wait_for(lambda: sim.kv_events.subscriptions > before, what="subscriber joined")
        yield Subscriber(sock)
    finally:
        sock.close(linger=0)
        ctx.term()


async def replay(endpoint: str, start: int, within: float = 5.0) -> list[Message]:
    """Ask the replay socket for every batch from ``start``; check the end marker."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        await sock.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[Message] = []
        async with asyncio.timeout(within):
            while True:
                frames = await sock.recv_multipart()
                assert len(frames) == 4, frames
                assert frames[0] == b""
                if frames[2] == END:
                    assert frames == [b"", b"", END, b""]
                    return out
                out.append(message(*frames[1:]))
    finally:
        sock.close(linger=0)
        ctx.term()


def published(sim: RunningSim) -> int:
    """How many batches the running publisher has sent (its next sequence number)."""
    publisher = sim.kv_events.publisher
    assert publisher is not None
    return publisher.next_seq


def stored(msgs: list[Message]) -> list[dict[str, Any]]:
    return [ev for m in msgs for ev in m.events if ev["type"] == "BlockStored"]


def kinds(msgs: list[Message]) -> list[str]:
    return [ev["type"] for m in msgs for ev in m.events]


# -- on the wire


async def test_block_stored_carries_the_prompt_tokens_in_one_event_per_step(
    client: aiohttp.ClientSession,
) -> None:
    prompt = words(40)  # two full blocks and 8 tokens
    async with running_sim(events_on()) as sim, subscribed(sim) as sub:
        await complete(client, sim, prompt)
        msg = await sub.next()
        assert (msg.topic, msg.seq, msg.rank) == (b"", 0, 0)
        assert len(msg.events) == 1
        ev = msg.events[0]
        hashes = ev["block_hashes"]
        assert ev == {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": tokenize(prompt)[: 2 * BS],
            "block_size": BS,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None, None],
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
        assert len(hashes) == 2
        assert all(isinstance(h, int) and 0 <= h <= U64 for h in hashes)
        assert len(set(hashes)) == 2
        assert published(sim) == 1  # the partial block is not cached: nothing more


async def test_blocks_of_successive_steps_chain_by_parent_hash(
    client: aiohttp.ClientSession,
) -> None:
    prompt = words(64)
    config = events_on(FAST.replace(max_num_batched_tokens=BS))  # one block per step
    async with running_sim(config) as sim, subscribed(sim) as sub:
        await complete(client, sim, prompt)
        msgs = await sub.until(4)
        assert [m.seq for m in msgs] == [0, 1, 2, 3]
        events = stored(msgs)
        assert [len(ev["block_hashes"]) for ev in events] == [1, 1, 1, 1]
        assert events[0]["parent_block_hash"] is None
        for before, after in itertools.pairwise(events):
            assert after["parent_block_hash"] == before["block_hashes"][0]
        assert [t for ev in events for t in ev["token_ids"]] == tokenize(prompt)
        # The same prompt again is served from the cache: nothing new is stored.
        await complete(client, sim, prompt)
        assert sim.engine.stats.prefix_cache_hits == 3 * BS
        assert published(sim) == 4


async def test_a_block_filled_while_decoding_carries_the_generated_tokens(
    client: aiohttp.ClientSession,
) -> None:
    prompt = words(10)
    async with running_sim(events_on()) as sim, subscribed(sim) as sub:
        doc = await complete(client, sim, prompt, max_tokens=8, ignore_eos=True)
        generated = tokenize(doc["choices"][0]["text"])
        ev = stored([await sub.next()])[0]
        assert ev["parent_block_hash"] is None
        assert ev["token_ids"] == (tokenize(prompt) + generated)[:BS]


async def test_a_request_that_fills_no_block_publishes_nothing(
    client: aiohttp.ClientSession,
) -> None:
    async with running_sim(events_on()) as sim, subscribed(sim):
        await complete(client, sim, words(BS - 4), max_tokens=2)
        assert sim.engine.stats.steps >= 2
        assert published(sim) == 0


async def test_published_hashes_are_the_same_in_every_simulator(
    client: aiohttp.ClientSession,
) -> None:
    prompt = words(48)
    async with running_sim(events_on()) as a, running_sim(events_on()) as b:
        async with subscribed(a) as sub_a, subscribed(b) as sub_b:
            await complete(client, a, prompt)
            await complete(client, b, prompt)
            ha = stored([await sub_a.next()])[0]["block_hashes"]
            hb = stored([await sub_b.next()])[0]["block_hashes"]
    assert ha == hb == block_hashes(tokenize(prompt), BS)


async def test_eviction_sends_block_removed_for_hashes_stored_before(
    client: aiohttp.ClientSession,
) -> None:
    small = FAST.replace(num_gpu_blocks_override=8, max_model_len=8 * BS)
    async with running_sim(events_on(small)) as sim, subscribed(sim) as sub:
        await complete(client, sim, words(4 * BS, "a"))  # 4 blocks, cached once freed
        first = stored([await sub.next()])[0]["block_hashes"]
        assert sim.engine.pool.num_cached == 4
        await complete(client, sim, words(100, "b"))  # 7 blocks: 3 of a's are evicted
        msg = await sub.next()
        removed = [ev for ev in msg.events if ev["type"] == "BlockRemoved"]
        assert len(removed) == 3
        for ev in removed:
            assert ev == {
                "type": "BlockRemoved",
                "block_hashes": ev["block_hashes"],
                "medium": "GPU",
                "group_idx": 0,
            }
            assert len(ev["block_hashes"]) == 1
        gone = {ev["block_hashes"][0] for ev in removed}
        assert gone <= set(first)
        assert first[0] not in gone  # the shared beginning is evicted last
        assert kinds([msg]) == ["BlockRemoved"] * 3 + ["BlockStored"]
        assert len(stored([msg])[0]["block_hashes"]) == 6


# -- replay


async def test_replay_returns_the_buffered_batches_then_the_end_marker(
    client: aiohttp.ClientSession,
) -> None:
    config = events_on(topic="kv", buffer_steps=3)
    async with running_sim(config) as sim:
        prompts = [words(BS, f"p{i}-") for i in range(4)]
        for prompt in prompts:
            await complete(client, sim, prompt)  # nobody listens: all missed
        assert published(sim) == 4
        endpoint = sim.kv_events.replay_endpoint
        assert endpoint is not None
        assert endpoint.startswith("tcp://127.0.0.1:")

        msgs = await replay(endpoint, 0)
        assert [m.seq for m in msgs] == [1, 2, 3]  # the buffer keeps the last 3
        assert {m.topic for m in msgs} == {b"kv"}
        assert [ev["token_ids"] for ev in stored(msgs)] == [tokenize(p) for p in prompts[1:]]
        assert [m.seq for m in await replay(endpoint, 2)] == [2, 3]
        assert await replay(endpoint, 9) == []


async def test_a_bad_replay_request_is_ignored_and_the_next_one_answered(
    client: aiohttp.ClientSession,
) -> None:
    async with running_sim(events_on()) as sim:
        await complete(client, sim, words(BS))
        endpoint = sim.kv_events.replay_endpoint
        assert endpoint is not None
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.connect(endpoint)
            await sock.send_multipart((b"", b"x", b"y"))  # not (b"", start)
            await sock.send_multipart((b"", (0).to_bytes(8, "big")))
            async with asyncio.timeout(5):
                first = await sock.recv_multipart()
                last = await sock.recv_multipart()
            assert int.from_bytes(first[2], "big") == 0
            assert last == [b"", b"", END, b""]
        finally:
            sock.close(linger=0)
            ctx.term()


async def test_a_subscriber_that_joins_late_fills_the_gap_from_replay(
    client: aiohttp.ClientSession,
) -> None:
    async with running_sim(events_on()) as sim:
        await complete(client, sim, words(BS, "early"))
        async with subscribed(sim) as sub:
            await complete(client, sim, words(BS, "late"))
            live = await sub.next()
            assert live.seq == 1
            endpoint = sim.kv_events.replay_endpoint
            assert endpoint is not None
            missed = await replay(endpoint, 0)
        assert [m.seq for m in missed] == [0, 1]
        assert missed[1].events == live.events


# -- /kv_event_sources and /reset_prefix_cache


async def test_kv_event_sources_answers_the_bound_endpoints(
    client: aiohttp.ClientSession,
) -> None:
    async with running_sim(events_on(topic="t", buffer_steps=5, hwm=7)) as sim:
        async with client.get(f"{sim.url}/kv_event_sources") as resp:
            assert resp.status == 200
            doc = await resp.json()
    assert doc == {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": sim.kv_events.endpoint,
            "replay_endpoint": sim.kv_events.replay_endpoint,
            "buffer_steps": 5,
            "hwm": 7,
            "max_queue_size": 100_000,
            "topic": "t",
        }
    }
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", doc["0"]["endpoint"])
    assert not doc["0"]["endpoint"].endswith(":0")


async def test_without_a_replay_endpoint_only_the_pub_socket_is_bound(
    client: aiohttp.ClientSession,
) -> None:
    async with running_sim(events_on(replay_endpoint=None)) as sim:
        async with client.get(f"{sim.url}/kv_event_sources") as resp:
            doc = await resp.json()
        assert doc["0"]["replay_endpoint"] is None
        assert sim.kv_events.replay_endpoint is None
        async with subscribed(sim) as sub:
            await complete(client, sim, words(BS))
            assert stored([await sub.next()])


async def test_reset_prefix_cache_publishes_all_blocks_cleared(
    client: aiohttp.ClientSession,
) -> None:
    prompt = words(2 * BS + 1)
    async with running_sim(events_on()) as sim, subscribed(sim) as sub:
        await complete(client, sim, prompt)
        await sub.next()
        assert sim.engine.pool.num_cached == 2
        async with client.post(f"{sim.url}/reset_prefix_cache") as resp:
            assert resp.status == 200
            assert await resp.json() == {"success": True}
        msg = await sub.next()
        assert (msg.seq, msg.events) == (1, [{"type": "AllBlocksCleared"}])
        assert sim.engine.pool.num_cached == 0
        await complete(client, sim, prompt)  # computed again, and stored again
        assert sim.engine.stats.prefix_cache_hits == 0
        assert stored([await sub.next()])[0]["token_ids"] == tokenize(prompt)[: 2 * BS]


async def test_reset_is_refused_while_requests_hold_blocks_unless_they_are_preempted(
    client: aiohttp.ClientSession,
) -> None:
    async with running_sim(events_on()) as sim, subscribed(sim) as sub:
        url = f"{sim.url}/reset_prefix_cache"
        body = completion_body(words(2 * BS), **STREAM)
        async with client.post(f"{sim.url}/v1/completions", json=body) as stream:
            await stream.content.readuntil(b"\n\n")  # decoding
            async with client.post(url) as resp:
                assert await resp.json() == {"success": False}
            assert sim.engine.pool.num_cached >= 2  # untouched (decoding may add a block)
            async with client.post(url, params={"reset_running_requests": "true"}) as resp:
                assert await resp.json() == {"success": True}
            assert sim.engine.stats.num_preemptions == 1
            seen: list[str] = []
            while "AllBlocksCleared" not in seen:
                seen += kinds([await sub.next()])
            # Only stores before it (the prompt's, perhaps a decoded block): the refused
            # reset published nothing.
            assert seen[:-1] == ["BlockStored"] * (len(seen) - 1)
            assert seen[-1] == "AllBlocksCleared"
            text = await stream.text()
        assert text.endswith("data: [DONE]\n\n")  # recomputed, then finished as asked
        async with client.post(url, params={"reset_running_requests": "maybe"}) as resp:
            assert resp.status == 400


# -- the simulator-only wire options


async def test_positional_wire_form(client: aiohttp.ClientSession) -> None:
    small = FAST.replace(num_gpu_blocks_override=8, max_model_len=8 * BS)
    async with running_sim(events_on(small, wire="positional")) as sim, subscribed(sim) as sub:
        await complete(client, sim, words(4 * BS, "a"))
        msg = await sub.next()
        assert msg.rank == 0
        [ev] = msg.events
        assert ev == ["BlockStored", ev[1], None, tokenize(words(4 * BS, "a")), BS, None, "GPU"]
        assert len(ev[1]) == 4
        await complete(client, sim, words(100, "b"))
        events = (await sub.next()).events
        removed = [e for e in events if e[0] == "BlockRemoved"]
        assert len(removed) == 3
        for e in removed:
            assert len(e) == 3
            assert e[2] == "GPU"
            assert e[1][0] in ev[1]
        async with client.post(f"{sim.url}/reset_prefix_cache") as resp:
            assert await resp.json() == {"success": True}
        assert (await sub.next()).events == [["AllBlocksCleared"]]


async def test_bytes_hashes_are_32_bytes_whose_low_64_bits_are_the_int_form(
    client: aiohttp.ClientSession,
) -> None:
    prompt = words(2 * BS)
    one_block_a_step = FAST.replace(max_num_batched_tokens=BS)
    as_bytes = events_on(one_block_a_step, hashes="bytes")
    async with running_sim(as_bytes) as b, running_sim(events_on(one_block_a_step)) as i:
        async with subscribed(b) as sub_b, subscribed(i) as sub_i:
            await complete(client, b, prompt)
            await complete(client, i, prompt)
            eb = stored(await sub_b.until(2))
            ei = stored(await sub_i.until(2))
    hashes = [ev["block_hashes"][0] for ev in eb]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    assert eb[1]["parent_block_hash"] == hashes[0]
    assert [int.from_bytes(h, "big") & U64 for h in hashes] == [ev["block_hashes"][0] for ev in ei]


# -- restarts


async def test_a_restarted_simulator_starts_at_seq_0_on_the_same_endpoints(
    client: aiohttp.ClientSession,
) -> None:
    prompt = words(2 * BS)
    sim = RunningSim(events_on())
    await sim.start()
    try:
        endpoints = (sim.kv_events.endpoint, sim.kv_events.replay_endpoint)
        async with subscribed(sim) as sub:
            await complete(client, sim, prompt)
            await complete(client, sim, words(BS, "other"))
            assert [m.seq for m in await sub.until(2)] == [0, 1]
            await sim.kill()
            assert sim.kv_events.publisher is None
            # A subscriber waiting in recv reconnects by itself and subscribes again.
            receiving = asyncio.create_task(sub.next(within=10))
            await sim.start()
            assert (sim.kv_events.endpoint, sim.kv_events.replay_endpoint) == endpoints
            await wait_for(lambda: sim.kv_events.subscriptions > 0, what="resubscribed")
            await complete(client, sim, prompt)
            msg = await receiving
        assert msg.seq == 0
        # A new process has an empty cache: the prompt is stored again, from its start.
        [ev] = stored([msg])
        assert ev["parent_block_hash"] is None
        assert ev["token_ids"] == tokenize(prompt)
        assert sim.engine.pool.num_cached == 2
        replay_endpoint = sim.kv_events.replay_endpoint
        assert replay_endpoint is not None
        assert [m.seq for m in await replay(replay_endpoint, 0)] == [0]
    finally:
        await sim.stop()


def test_a_new_process_publishes_from_seq_0_and_names_its_endpoints() -> None:
    flag = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:0",
            "replay_endpoint": "tcp://*:0",
            "topic": "",
        }
    )
    argv = [sys.executable, "-m", "gateway", "sim", "--port", "0", "--kv-events-config", flag]
    with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stderr is not None
            url = re.search(r"on (http://\S+)", proc.stderr.readline())
            line = proc.stderr.readline()
            kv = re.search(r"KV events on (tcp://\S+), replay on (tcp://\S+)", line)
            assert url, "no serving line"
            assert kv, line
            with urllib.request.urlopen(f"{url.group(1)}/kv_event_sources", timeout=5) as resp:
                sources = json.load(resp)
            assert sources["0"]["endpoint"] == kv.group(1)
            assert sources["0"]["replay_endpoint"] == kv.group(2)
            prompt = words(BS + 3)
            body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
            post = urllib.request.Request(
                f"{url.group(1)}/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(post, timeout=5) as resp:
                assert resp.status == 200
            with sync_dealer(kv.group(2)) as dealer:
                dealer.send_multipart((b"", (0).to_bytes(8, "big")))
                first = dealer.recv_multipart()
                assert dealer.recv_multipart() == [b"", b"", END, b""]
            msg = message(*first[1:])
            assert msg.seq == 0
            assert stored([msg])[0]["token_ids"] == tokenize(prompt)[:BS]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
        finally:
            proc.kill()


@contextmanager
def sync_dealer(endpoint: str) -> Iterator[zmq.Socket[bytes]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        sock.connect(endpoint)
        yield sock
    finally:
        sock.close(linger=0)
        ctx.term()


# -- off


@pytest.mark.parametrize(
    "kv_events",
    [
        None,
        KvEventsConfig(enable_kv_cache_events=False, endpoint="tcp://*:0"),
        KvEventsConfig(enable_kv_cache_events=True, publisher="null", endpoint="tcp://*:0"),
    ],
    ids=["no-flag", "disabled", "null-publisher"],
)
async def test_with_events_off_no_socket_is_opened_and_sources_are_empty(
    client: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    kv_events: KvEventsConfig | None,
) -> None:
    def no_context() -> None:
        raise AssertionError("a ZMQ context was created with events off")

    monkeypatch.setattr("tools.sim.kvevents.zmq.Context", no_context)
    async with running_sim(FAST.replace(kv_events=kv_events)) as sim:
        await complete(client, sim, words(2 * BS))
        async with client.get(f"{sim.url}/kv_event_sources") as resp:
            assert await resp.json() == {}
        assert sim.kv_events.publisher is None
        assert sim.kv_events.endpoint is None
        assert sim.engine.pool.events is None  # nothing recorded either
        async with client.post(f"{sim.url}/reset_prefix_cache") as resp:
            assert await resp.json() == {"success": True}  # still served, with nothing sent


# -- the pool and the engine, without I/O


def request(rid: int, prompt: tuple[int, ...], out: int = 1) -> Request:
    return Request(rid, prompt, out, "length", OutputText(seed=rid), 0.0)


def engine_on(**changes: Any) -> Engine:
    return Engine(events_on(FAST.replace(**changes)))


def test_one_step_stores_a_sequences_new_blocks_as_one_event() -> None:
    engine = engine_on()
    prompt = tuple(range(4 * BS + 3))
    engine.add_request(request(1, prompt))
    engine.step(0.0)
    [ev] = engine.pool.take_events()
    assert isinstance(ev, CacheStored)
    assert ev.parent is None
    assert ev.token_ids == list(prompt[: 4 * BS])
    assert len(ev.hashes) == 4
    assert engine.pool.take_events() == []


def test_a_shared_prefix_is_stored_once_and_its_continuation_names_its_parent() -> None:
    engine = engine_on()
    shared = tuple(range(2 * BS))
    engine.add_request(request(1, (*shared, 1)))
    engine.step(0.0)
    [first] = engine.pool.take_events()
    assert isinstance(first, CacheStored)
    while engine.has_work():
        engine.step(engine.clock)
    engine.add_request(request(2, (*shared, *range(100, 100 + BS + 1))))
    engine.step(engine.clock)
    [second] = engine.pool.take_events()
    assert isinstance(second, CacheStored)
    assert second.parent == first.hashes[-1]
    assert second.token_ids == list(range(100, 100 + BS))


def test_the_events_replayed_give_exactly_the_cached_hashes() -> None:
    """Under eviction, preemption, resets and shared prefixes, applying the recorded
    events to an empty set gives the pool's index: no store or removal is missing."""
    engine = engine_on(num_gpu_blocks_override=24, max_model_len=24 * BS, max_num_seqs=4)
    rng = random.Random(7)
    index: set[int] = set()

    def apply() -> None:
        for ev in engine.pool.take_events():
            if isinstance(ev, CacheStored):
                assert not index & set(ev.hashes), "stored twice"
                index.update(ev.hashes)
            elif isinstance(ev, CacheRemoved):
                index.remove(ev.hash)
            else:
                assert isinstance(ev, CacheCleared)
                index.clear()

    prefixes = [tuple(rng.randrange(50) for _ in range(rng.randrange(1, 4) * BS)) for _ in "abc"]
    for rid in range(1, 200):
        prompt = rng.choice(prefixes) + tuple(rng.randrange(50) for _ in range(rng.randrange(60)))
        engine.add_request(request(rid, prompt, out=rng.randrange(1, 40)))
        for _ in range(rng.randrange(4)):
            engine.step(engine.clock)
        if rid % 50 == 0:
            engine.reset_prefix_cache(reset_running_requests=True)
        apply()
        assert index == set(engine.pool._cached)
    assert engine.stats.num_preemptions > 0


def test_clear_is_refused_while_a_block_is_referenced() -> None:
    pool = BlockPool(4, BS, record_events=True)
    [a, b] = pool.allocate(2) or []
    pool.register(a, 11)
    pool.register(b, 12, 11, range(BS))
    assert not pool.clear()
    pool.free([a, b])
    assert pool.clear()
    assert pool.num_cached == 0
    assert pool.take_events() == [
        CacheStored([11, 12], None, list(range(BS))),
        CacheCleared(),
    ]


def test_a_pool_without_events_records_nothing() -> None:
    pool = BlockPool(2, BS)
    [a] = pool.allocate(1) or []
    pool.register(a, 1)
    pool.free([a])
    pool.allocate(2)  # evicts 1
    assert pool.events is None
    assert pool.take_events() == []


# -- the flag


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_the_flag_takes_vllms_json_and_the_simulators_options() -> None:
    flag: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "buffer_steps": 10,
        "hwm": 5,
        "max_queue_size": 3,
        "topic": "kv",
        "wire": "positional",
        "hashes": "bytes",
    }
    config = config_from_args(parse("--kv-events-config", json.dumps(flag)))
    assert config.kv_events == KvEventsConfig(**flag)
    assert config.publishes_kv_events
    assert config_from_args(parse()).kv_events is None
    enabled_only = KvEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert enabled_only.publisher_kind == "zmq"  # vLLM's default once enabled
    assert enabled_only.endpoint == "tcp://*:5557"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown key(s) 'endpont'"),
        ("{enable_kv_cache_events: true}", "not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"wire": "xml"}', "wire"),
        ('{"buffer_steps": -1}', "buffer_steps must not be negative"),
    ],
)
def test_a_bad_flag_is_refused_with_what_is_wrong(
    text: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        KvEventsConfig.from_json(text)
    assert run(parse("--kv-events-config", text)) == 2
    assert says in capsys.readouterr().err
