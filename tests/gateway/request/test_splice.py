"""The stream fast path (a tap on the upstream body, written straight to the client).

Flow control with a client that stops reading, a backend that lies in its chunk framing, and
keep-alive reuse of the upstream connection after a spliced stream.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp
from aiohttp import web

from gateway.http import Server
from gateway.request.services import Services
from tests.helpers import (
    FakeBackend,
    Seen,
    chat_chunk,
    fronting,
    gateway_for,
    running_fake,
    running_gateway,
    sse,
    stream_chat,
    wait_for,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
EVENT = b"data: " + b"x" * 4090 + b"\n\n"  # 4 KiB events
N_EVENTS = 4096  # 16 MiB in all: far more than the gateway may buffer for one client
BOUND = 1 << 20  # what the gateway may hold for one slow client, at most


def in_gateway_for_clients(server: Server) -> int:
    """Bytes the gateway holds in its client-side transports, not yet taken by the kernel."""
    held = 0
    for conn in server.connections:
        if conn.transport is not None:
            held += conn.transport.get_write_buffer_size()
    return held


async def stop_reading_then_read_all(hold: float = 0.0, **gateway: Any) -> Services:
    """A client that reads nothing until the gateway has stopped reading the backend (which
    is then held back), waits ``hold`` seconds more, then reads the whole stream; checks the
    gateway's buffering stayed bounded and the stream arrived whole. Returns the gateway's services.
    """
    progress: dict[str, Any] = {"written": 0, "transport": None}

    async def big_stream(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        progress["transport"] = request.transport
        for _ in range(N_EVENTS):
            await resp.write(EVENT)  # waits whenever the gateway stops reading
            progress["written"] += 1
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def gateway_paused() -> bool:
        over = progress["written"] == N_EVENTS or in_gateway_for_clients(gw.server) > BOUND
        return over or any(t.paused for t in gw.svc.upstream.pool.tapped())

    def backend_held_back() -> bool:
        transport = progress["transport"]
        return progress["written"] == N_EVENTS or (
            transport is not None and transport.get_write_buffer_size() > 0
        )

    fake = FakeBackend(behaviour=big_stream)
    async with fronting(fake, **gateway) as gw:
        host, port = gw.url[len("http://") :].split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 16)
        body = json.dumps(CHAT).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        # The client reads nothing: the gateway stops reading the backend, which is held back.
        await wait_for(gateway_paused, within=20, what="the gateway to stop reading")
        assert in_gateway_for_clients(gw.server) < BOUND
        await wait_for(backend_held_back, within=20, what="the backend to be held back")
        assert progress["written"] < N_EVENTS, "the gateway read the whole stream"
        assert in_gateway_for_clients(gw.server) < BOUND
        await asyncio.sleep(hold)  # sleep-ok: the client keeps not reading for this long
        received = b""
        while not received.endswith(b"0\r\n\r\n"):
            chunk = await asyncio.wait_for(reader.read(1 << 20), 20)
            assert chunk, "the gateway closed the connection"
            received += chunk
        writer.close()
    assert received.count(b"data: x") == N_EVENTS
    assert received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert fake.seen[0].ending == "complete"
    return gw.svc


async def test_a_client_that_stops_reading_pauses_the_upstream_and_then_completes() -> None:
    await stop_reading_then_read_all()


async def test_a_client_that_stops_reading_longer_than_the_stall_limit_stalls_no_backend() -> None:
    # Its stream stands still for 3 s, longer than both the stall limit and the idle timeout:
    # that is the client's doing, so the backend is not taken out and the stream is not cut.
    svc = await stop_reading_then_read_all(
        hold=3.0, health={"stall_after": 1.0}, upstream={"idle_timeout": 2.0}
    )
    assert total(svc, "llm_gateway_backend_stalls_total") == 0
    assert total(svc, "llm_gateway_stream_continuations_total") == 0
    assert all(b.health.state.value == "up" for b in svc.pool.all())


def total(svc: Services, sample: str) -> float:
    """A metric's value summed over its label sets."""
    return sum(
        s.value for m in svc.metrics.registry.collect() for s in m.samples if s.name == sample
    )


async def test_a_backend_that_lies_in_its_chunk_framing_ends_the_stream_with_an_error() -> None:
    async def lying(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chat_chunk(role=True))
        await fake.release.wait()
        assert request.transport is not None
        request.transport.write(b"zz\r\nnot a chunk size\r\n")
        await asyncio.Event().wait()  # until the gateway closes the connection
        return resp

    fake = FakeBackend(behaviour=lying)
    async with fronting(fake) as gw:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(gw.url + "/v1/chat/completions", json=CHAT)
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
            assert first == chat_chunk(role=True)
            fake.release.set()
            rest = await asyncio.wait_for(resp.content.read(), 5)
        error = json.loads(rest.split(b"\n\n")[0][len(b"data: ") :])
        assert error["error"]["code"] == "backend_protocol_error"
        assert rest.endswith(b"data: [DONE]\n\n")
        await wait_for(lambda: fake.seen[0].ended_at is not None, what="upstream closed")
        assert fake.seen[0].ending == "cancelled"
        await wait_for(lambda: gw.in_flight() == {fake.url[7:]: 0}, what="lease released")


async def test_the_upstream_connection_of_a_spliced_stream_is_reused() -> None:
    fake = FakeBackend(behaviour=stream_chat(5, delay=0.002))
    async with gateway_for(fake) as (gw, s):
        for _ in range(3):
            async with s.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                body = await resp.read()
                assert body.count(b"data: ") == 8
                assert body.endswith(b"data: [DONE]\n\n")
    streams = [seen for seen in fake.seen if seen.path == "/v1/chat/completions"]
    assert len(streams) == 3
    peers = {seen.transport.get_extra_info("peername") for seen in streams if seen.transport}
    assert len(peers) == 1, peers


async def test_usage_of_a_spliced_stream_is_recorded_and_the_chunk_removed() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}

    async def with_usage(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chat_chunk(role=True))
        await fake.release.wait()  # the rest goes through the splice
        await resp.write(chat_chunk("t0 "))
        await resp.write(sse({"id": "x", "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    fake = FakeBackend(behaviour=with_usage)
    async with gateway_for(fake) as (gw, s):
        resp = await s.post(gw.url + "/v1/chat/completions", json=CHAT)
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        fake.release.set()
        rest = await asyncio.wait_for(resp.content.read(), 5)
    assert rest == chat_chunk("t0 ") + b"data: [DONE]\n\n"


async def test_the_answers_head_goes_out_with_its_first_chunk_in_one_write() -> None:
    writes: list[bytes] = []

    async def first_then_wait(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        # The gateway has the client's request and has written nothing back yet: watch what
        # it writes to the client from now on.
        (conn,) = gw.server.connections
        transport = conn.transport
        assert transport is not None
        write, writelines = transport.write, transport.writelines

        def spy_write(data: bytes) -> None:
            writes.append(bytes(data))
            write(data)

        def spy_writelines(lines: Any) -> None:
            lines = [bytes(line) for line in lines]
            writes.append(b"".join(lines))
            writelines(lines)

        transport.write = spy_write  # type: ignore[method-assign]
        transport.writelines = spy_writelines  # type: ignore[method-assign]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chat_chunk(role=True))
        await fake.release.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    fake = FakeBackend(behaviour=first_then_wait)
    async with gateway_for(fake) as (gw, s):
        resp = await s.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert resp.status == 200
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert first == chat_chunk(role=True)
        fake.release.set()
        assert await asyncio.wait_for(resp.content.read(), 5) == b"data: [DONE]\n\n"
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert chat_chunk(role=True) in writes[0]  # not a write of its own before the first chunk


async def head_then_break(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
    """A backend that sends its answer's head, then breaks off before its first chunk."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await asyncio.sleep(0.05)  # sleep-ok: the gateway is waiting for the first chunk by now
    assert request.transport is not None
    request.transport.abort()
    return resp


async def test_a_backend_breaking_between_its_head_and_first_chunk_leaves_the_client_unsent() -> (
    None
):
    """A backend that sends its head and breaks off before its first chunk has sent the client
    nothing (the client's head goes with the first chunk): another backend's stream reaches
    the client whole, as a stream; with no backend left the client gets the gateway's JSON
    error, framed as a whole answer (not chunked); the connection serves the next request."""
    breaking, healthy = (
        FakeBackend(behaviour=head_then_break),
        FakeBackend(behaviour=stream_chat(3)),
    )
    async with running_fake(breaking), running_fake(healthy):
        async with running_gateway([breaking.url, healthy.url], policy="round_robin") as gw:
            conn = aiohttp.TCPConnector(limit=1)  # one connection: every answer's framing counts
            async with aiohttp.ClientSession(connector=conn) as s:
                for _ in range(4):  # round robin: half of them try the breaking backend first
                    async with s.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                        assert resp.status == 200
                        assert resp.headers["Transfer-Encoding"] == "chunked"
                        body = await resp.read()
                    assert body.endswith(b"data: [DONE]\n\n")
                    assert body.count(b"data: ") == 6  # role, 3 tokens, the finish, [DONE]
        assert len(breaking.seen) >= 2  # the breaking backend was tried (and failed over)
        async with running_gateway([breaking.url], retry={"max_attempts": 2}) as gw:
            conn = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(connector=conn) as s:
                for _ in range(2):
                    async with s.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                        assert resp.status == 502, await resp.text()
                        assert "Transfer-Encoding" not in resp.headers
                        assert int(resp.headers["Content-Length"]) > 0
                        doc = await resp.json()
                    assert doc["error"]["type"]
                async with s.post(gw.url + "/v1/models") as resp:
                    assert resp.status in (200, 405)
