"""The relay's plain reads: what it does with an upstream it cannot tap (``relay_stream``'s
``readany`` / ``write`` loop, ``gateway.request.relay``), correctly, over real sockets.

The gateway is handed a transport (its seam for how backends are reached) that is the real
client with its responses' tap taken away, as an in-memory transport's are: no setting of the
gateway's own turns the splice off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from backends.state import BackendSpec
from backends.upstream.client import Interrupt, RequestBody, Upstream, UpstreamClient
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


class Untapped:
    """A ``Transport``: the real client, each response handed on without its tap
    (``Upstream.response`` None), so the relay cannot splice it."""

    def __init__(self) -> None:
        self.client = UpstreamClient(connect_timeout=2.0, idle_timeout=30.0)
        self._real: dict[int, Upstream] = {}  # what the client gave, by what was handed on

    async def open(
        self,
        backend: BackendSpec,
        path: str,
        body: RequestBody,
        headers: Mapping[str, str],
        *,
        interrupt: Interrupt | None = None,
    ) -> Upstream:
        real = await self.client.open(backend, path, body, headers, interrupt=interrupt)
        plain = dataclasses.replace(real, response=None)
        self._real[id(plain)] = real
        return plain

    async def read_body(self, upstream: Upstream) -> bytes:
        return await self.client.read_body(upstream)

    def finish(self, upstream: Upstream, *, complete: bool) -> None:
        self.client.finish(self._real.pop(id(upstream)), complete=complete)

    async def get(self, backend: BackendSpec, path: str, *, within: float) -> tuple[int, bytes]:
        return await self.client.get(backend, path, within=within)

    async def close(self) -> None:
        await self.client.close()


async def test_a_stream_relayed_with_plain_reads_arrives_whole_and_in_order() -> None:
    """Every event, in order, the usage chunk the client did not ask for removed, and no tap."""
    transport = Untapped()
    taps: list[int] = []

    async def long_stream(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chat_chunk(role=True))
        for i in range(200):
            await resp.write(chat_chunk(f"t{i} "))
            if i % 50 == 0:
                taps.append(len(transport.client.pool.tapped()))
                await asyncio.sleep(0)  # sleep-ok: let the gateway relay between writes
        usage = {"prompt_tokens": 1, "completion_tokens": 200, "total_tokens": 201}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    fake = FakeBackend(behaviour=long_stream)
    async with (
        gateway_for(fake, transport=transport) as (gw, s),
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
    async with fronting(held, transport=Untapped()) as gw:
        async with aiohttp.ClientSession() as s:
            r = await s.post(gw.url + "/v1/chat/completions", json=CHAT)
            await r.content.readuntil(b"t1")
            r.close()
            await wait_for(lambda: held.active() == 0, what="the upstream closed")
        assert held.seen[0].ending == "cancelled"
        await wait_for(lambda: set(gw.in_flight().values()) == {0}, what="released")
    async with gateway_for(dying, transport=Untapped()) as (gw, s):
        r = await s.post(gw.url + "/v1/chat/completions", json=CHAT)
        await r.content.readuntil(b"t1")
        await kill(dying)
        rest = await asyncio.wait_for(r.read(), 10)
    assert b'"error"' in rest
    assert rest.endswith(b"data: [DONE]\n\n")
