"""The relay's fallback: when aiohttp's writer is not as the splice expects, streams are
relayed with plain reads, correctly, and the gateway says so once (issue 17)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web
from structlog.testing import capture_logs

from gateway.keys import UPSTREAM
from tests.helpers import (
    FakeBackend,
    Seen,
    chat_chunk,
    fronting,
    gateway_for,
    kill,
    stream_chat,
    wait_for,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def forced() -> str:
    return "the splice switched off, forced by the test"


async def test_the_fallback_is_logged_once_and_shown_in_a_metric() -> None:
    fake = FakeBackend(behaviour=stream_chat(3))
    with capture_logs() as logs:
        async with gateway_for(fake, relay_check=forced) as (gw, s):
            async with s.get(gw.url + "/metrics") as r:
                text = await r.text()
    warnings = [e for e in logs if e["event"] == "relay_fast_path_off"]
    assert len(warnings) == 1
    assert "forced by the test" in warnings[0]["reason"]
    assert "llm_gateway_relay_plain_reads 1.0" in text


async def test_a_stream_relayed_with_plain_reads_arrives_whole_and_in_order() -> None:
    """Every event, in order, the usage chunk the client did not ask for removed, and no tap."""
    taps: list[int] = []

    async def long_stream(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chat_chunk(role=True))
        for i in range(200):
            await resp.write(chat_chunk(f"t{i} "))
            if i % 50 == 0:
                taps.append(len(gw.app[UPSTREAM].pool.tapped()))
                await asyncio.sleep(0)  # sleep-ok: let the gateway relay between writes
        usage = {"prompt_tokens": 1, "completion_tokens": 200, "total_tokens": 201}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    fake = FakeBackend(behaviour=long_stream)
    async with (
        gateway_for(fake, relay_check=forced) as (gw, s),
        s.post(gw.url + "/v1/chat/completions", json=CHAT) as r,
    ):
        body = await r.read()
    contents = [
        json.loads(line[6:])["choices"][0]["delta"].get("content")
        for line in body.decode().split("\n\n")
        if line.startswith("data: {")
    ]
    assert contents == ["", *(f"t{i} " for i in range(200))]
    assert body.endswith(b"data: [DONE]\n\n")
    assert b'"usage"' not in body  # asked for upstream for the limits, not shown to the client
    assert set(taps) == {0}  # the fast path was never used


async def test_plain_reads_still_abort_on_disconnect_and_end_a_broken_stream_with_an_error() -> (
    None
):
    held = FakeBackend(behaviour=stream_chat(10, hold_after=2))
    dying = FakeBackend(behaviour=stream_chat(10, hold_after=2))
    async with fronting(held, relay_check=forced) as gw:
        async with aiohttp.ClientSession() as s:
            r = await s.post(gw.url + "/v1/chat/completions", json=CHAT)
            await r.content.readuntil(b"t1")
            r.close()
            await wait_for(lambda: held.active() == 0, what="the upstream closed")
        assert held.seen[0].ending == "cancelled"
        await wait_for(lambda: set(gw.in_flight().values()) == {0}, what="released")
    async with gateway_for(dying, relay_check=forced) as (gw, s):
        r = await s.post(gw.url + "/v1/chat/completions", json=CHAT)
        await r.content.readuntil(b"t1")
        await kill(dying)
        rest = await asyncio.wait_for(r.read(), 10)
    assert b'"error"' in rest
    assert rest.endswith(b"data: [DONE]\n\n")
