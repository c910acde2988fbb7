"""A client that goes away stops the upstream work at once, and nothing leaks, in every phase."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.limits.memory import MemoryLimitStore
from tests.helpers import (
    FakeBackend,
    Seen,
    chat_chunk,
    fronting,
    hang_before_headers,
    stream_chat,
    wait_for,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
# Each backend here holds its answer until released, which never comes, and the idle timeout
# is the default 120 s: an upstream ended "cancelled" can only be the client's leaving passed
# on. (How soon is the machine's speed, not the gateway's behaviour: not asserted.)


async def upstream_closed(fake: FakeBackend) -> None:
    await wait_for(
        lambda: bool(fake.seen) and fake.seen[0].ended_at is not None,
        what="backend handler to end",
    )
    assert fake.seen[0].ending == "cancelled"


async def test_disconnect_mid_stream_closes_upstream() -> None:
    fake = FakeBackend(behaviour=stream_chat(50, hold_after=3))
    async with fronting(fake) as gw:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(gw.url + "/v1/chat/completions", json=CHAT | {"stream": True})
            got = b""
            while b"t2 " not in got:
                got += await asyncio.wait_for(resp.content.readany(), 5)
            resp.close()
            await upstream_closed(fake)
        await wait_for(lambda: gw.in_flight() == {fake.url[7:]: 0}, what="lease released")


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_while_waiting_for_first_byte_closes_upstream(stream: bool) -> None:
    fake = FakeBackend(behaviour=hang_before_headers)
    async with fronting(fake) as gw:
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(
                s.post(gw.url + "/v1/chat/completions", json=CHAT | {"stream": stream})
            )
            await wait_for(lambda: len(fake.seen) == 1, what="request to reach the backend")
            task.cancel()  # aiohttp closes the client connection
            with pytest.raises(asyncio.CancelledError):
                await task
            await upstream_closed(fake)
        await wait_for(lambda: gw.in_flight() == {fake.url[7:]: 0}, what="lease released")


async def test_disconnect_during_non_streaming_body_closes_upstream() -> None:
    async def slow_body(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"id": "cmpl-1", "choices": [')
        await fake.release.wait()
        await resp.write(b"]}")
        return resp

    fake = FakeBackend(behaviour=slow_body)
    async with fronting(fake) as gw:
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(gw.url + "/v1/completions", json=CHAT))
            await wait_for(lambda: len(fake.seen) == 1, what="request to reach the backend")
            await asyncio.sleep(0.05)  # sleep-ok: let the head and half a body reach the gateway
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await upstream_closed(fake)
        await wait_for(lambda: gw.in_flight() == {fake.url[7:]: 0}, what="lease released")


async def test_disconnect_before_the_body_is_read_sends_nothing_upstream() -> None:
    fake = FakeBackend()
    async with fronting(fake) as gw:
        host, port = gw.url[7:].split(":")
        _reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"model": "m", "prompt": "'
        )
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        # The gateway is still waiting for the body when the client goes: nothing is leased.
        async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/completions", json=CHAT):
            pass
        assert len(fake.seen) == 1
        assert gw.in_flight() == {fake.url[7:]: 0}


async def test_no_lease_or_connection_leaks_after_hundreds_of_mixed_requests() -> None:
    """Normal, failing, timing-out and cancelled requests, streaming or not, interleaved."""

    async def mixed(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        mode = json.loads(seen.body).get("mode")
        if mode == "error":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if mode == "hang":
            await asyncio.sleep(10)  # sleep-ok: a hung backend, cut by the idle timeout
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(8):
            await resp.write(chat_chunk(f"t{i}"))
            await asyncio.sleep(0.002)  # sleep-ok: pacing of a simulated token stream
            if mode == "die" and i == 3:
                assert request.transport is not None
                request.transport.abort()
                return resp
        await resp.write(b"data: [DONE]\n\n")
        return resp

    a, b = FakeBackend(behaviour=mixed), FakeBackend(behaviour=mixed)
    rng = random.Random(7)
    modes = ["ok", "ok", "ok", "error", "hang", "die", "cancel", "cancel_early", "bad", "unknown"]
    outcomes: dict[str, int] = {}

    async with fronting(
        a,
        b,
        upstream={"idle_timeout": 0.3},
        # The circuit breaker would shut both failing backends out; this test is about leaks.
        health={"circuit_threshold": 10_000},
        # Concurrency slots and the admission queue are in the path too.
        limits={
            "tiers": {"default": {"max_concurrent": 64}},
            "admission": {"enabled": True, "max_in_flight": 12, "max_wait": 5},
        },
    ) as gw:
        connector = aiohttp.TCPConnector(limit=64)
        async with aiohttp.ClientSession(connector=connector) as s:

            async def one(mode: str) -> None:
                body: Any = CHAT | {"stream": True, "mode": mode}
                if mode == "bad":
                    body = "{oops"
                elif mode == "unknown":
                    body = CHAT | {"model": "other"}
                data = body if isinstance(body, str) else json.dumps(body)
                try:
                    async with s.post(gw.url + "/v1/chat/completions", data=data) as r:
                        if mode == "cancel_early":
                            return
                        if mode == "cancel":
                            await r.content.readany()
                            r.close()
                            return
                        await r.read()
                        key = f"{mode}:{r.status}"
                        outcomes[key] = outcomes.get(key, 0) + 1
                except aiohttp.ClientError as exc:
                    outcomes[f"{mode}:{type(exc).__name__}"] = 1

            await asyncio.gather(*(one(rng.choice(modes)) for _ in range(400)))

        await wait_for(lambda: set(gw.in_flight().values()) == {0}, what="every lease released")
        await wait_for(lambda: a.active() + b.active() == 0, what="every upstream closed")
        queue = gw.svc.admission
        assert queue is not None
        await wait_for(lambda: queue.holding == 0 and queue.waiting == 0, what="queue empty")
        # Every concurrency slot came back.
        store = gw.svc.limiter.store
        assert isinstance(store, MemoryLimitStore)
        await wait_for(lambda: store.slots_in_use("anonymous") == 0, what="slots released")
    assert outcomes.get("error:500", 0) > 0
    assert outcomes.get("hang:504", 0) > 0
    assert outcomes.get("bad:400", 0) > 0
    assert outcomes.get("unknown:404", 0) > 0
    assert outcomes.get("ok:200", 0) > 0
    assert len(a.seen) + len(b.seen) > 250
