"""Backends appearing and leaving (DNS), draining, and the gateway's own shutdown."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
from typing import Any

import aiohttp
import pytest

from gateway.server import stop_gracefully
from tests.helpers import (
    FakeBackend,
    bound_socket,
    running_fake,
    running_gateway,
    stream_chat,
    wait_for,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
TOKEN = "admin-secret"


class FakeResolver:
    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers

    async def resolve(self, host: str, port: int) -> list[str]:
        return list(self.answers[host])


def same_port_on_two_addresses() -> tuple[socket.socket, socket.socket]:
    for _ in range(20):
        first = bound_socket("127.0.0.2")
        try:
            return first, bound_socket("127.0.0.3", first.getsockname()[1])
        except OSError:
            first.close()
    raise AssertionError("no port free on both 127.0.0.2 and 127.0.0.3")


async def test_dns_changes_add_and_remove_backends_without_dropping_streams() -> None:
    sock_a, sock_b = same_port_on_two_addresses()
    port = sock_a.getsockname()[1]
    a = FakeBackend(behaviour=stream_chat(6, hold_after=2))
    b = FakeBackend(behaviour=stream_chat(3))
    resolver = FakeResolver({"svc": ["127.0.0.2"]})
    async with (
        running_fake(a, sock=sock_a),
        running_fake(b, sock=sock_b),
        running_gateway(
            [], discovery={"dns": [f"svc:{port}"], "interval": 0.05}, resolver=resolver
        ) as gw,
        aiohttp.ClientSession() as s,
    ):
        pool = gw.svc.pool
        a_id, b_id = f"127.0.0.2:{port}", f"127.0.0.3:{port}"
        await wait_for(gw.ready, what="discovered backend routable")
        held = await s.post(gw.url + "/v1/chat/completions", json=CHAT)
        await wait_for(lambda: a.active() == 1, what="stream running on a")

        resolver.answers["svc"] = ["127.0.0.3"]
        await wait_for(lambda: pool.get(b_id) is not None, what="b discovered")
        state_a = pool.get(a_id)
        assert state_a is not None
        assert state_a.removed  # gone from DNS, kept while its stream runs
        await wait_for(lambda: pool.routable(pool.get(b_id), pool.now()), what="b probed up")  # type: ignore[arg-type]
        for _ in range(5):
            async with s.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
                await r.read()
        assert len(a.seen) == 1
        assert len(b.seen) == 5

        a.release.set()
        body = await held.read()
        assert body.endswith(b"data: [DONE]\n\n")
        assert b'"error"' not in body
        await wait_for(lambda: pool.get(a_id) is None, what="a forgotten once idle")

        resolver.answers["svc"] = ["127.0.0.2", "127.0.0.3"]
        await wait_for(lambda: pool.get(a_id) is not None, what="a back in DNS")


async def test_drain_through_the_admin_api_and_the_config_flag() -> None:
    a = FakeBackend(behaviour=stream_chat(4, hold_after=1))
    b = FakeBackend(behaviour=stream_chat(2))
    async with (
        running_fake(a),
        running_fake(b),
        running_gateway([a.url, b.url], admin={"token": TOKEN}, policy="round_robin") as gw,
        aiohttp.ClientSession() as s,
    ):
        assert gw.admin_url is not None
        a_id = a.url[7:]
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with s.post(f"{gw.admin_url}/admin/backends/{a_id}/drain") as r:
            assert r.status == 401  # no token, no admin
        held = None
        while held is None:  # round robin: get one stream onto a
            r = await s.post(gw.url + "/v1/chat/completions", json=CHAT)
            if a.active():
                held = r
            else:
                await r.read()
        async with s.post(f"{gw.admin_url}/admin/backends/{a_id}/drain", headers=auth) as r:
            assert r.status == 200
            assert (await r.json())["draining"] is True
        seen_a = len(a.seen)
        for _ in range(6):
            async with s.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
                await r.read()
        assert len(a.seen) == seen_a  # no new request while draining
        a.release.set()
        assert (await held.read()).endswith(b"data: [DONE]\n\n")  # in-flight one completes
        async with s.get(f"{gw.admin_url}/admin/backends", headers=auth) as r:
            listed = {x["id"]: x for x in (await r.json())["backends"]}
        assert listed[a_id]["draining"] is True
        assert listed[a_id]["in_flight"] == 0
        async with s.post(f"{gw.admin_url}/admin/backends/{a_id}/undrain", headers=auth) as r:
            assert r.status == 200
        async with s.post(f"{gw.admin_url}/admin/backends/nope/drain", headers=auth) as r:
            assert r.status == 404
        for _ in range(4):
            async with s.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
                await r.read()
        assert len(a.seen) > seen_a

    c = FakeBackend()
    async with (
        running_fake(c),
        running_gateway([{"url": c.url, "drain": True}]) as gw,  # type: ignore[list-item]
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/completions", json={"model": "m"}) as r,
    ):
        assert r.status == 503
        assert c.seen == []


async def test_shutdown_lets_in_flight_streams_finish_and_refuses_new_work() -> None:
    fake = FakeBackend(behaviour=stream_chat(10, delay=0.03))
    async with (
        running_fake(fake),
        running_gateway([fake.url], shutdown_grace=5) as gw,
        aiohttp.ClientSession() as s,
    ):
        streams = [await s.post(gw.url + "/v1/chat/completions", json=CHAT) for _ in range(3)]
        stopping = asyncio.create_task(stop_gracefully(gw.svc, gw.server, []))
        await wait_for(lambda: gw.svc.lifecycle.stopping, what="stopping")
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as fresh:
                await fresh.get(gw.url + "/ready")
        bodies = [await r.read() for r in streams]
        await asyncio.wait_for(stopping, 5)
    for body in bodies:
        assert body.endswith(b"data: [DONE]\n\n")
        assert b'"error"' not in body


async def test_shutdown_closes_idle_kept_alive_connections_while_streams_finish() -> None:
    """What docs/operations.md says of SIGTERM: an idle kept-alive connection is closed (its
    client's next request fails to connect, so it goes elsewhere), not answered 503 (issue 23)."""
    fake = FakeBackend(behaviour=stream_chat(10, delay=0.03))
    async with running_fake(fake), running_gateway([fake.url], shutdown_grace=5) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        async with aiohttp.ClientSession() as s:
            stream = await s.post(gw.url + "/v1/chat/completions", json=CHAT)
            stopping = asyncio.create_task(stop_gracefully(gw.svc, gw.server, []))
            await wait_for(lambda: gw.svc.lifecycle.stopping, what="stopping")
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)  # the first answer's body
            rest = await asyncio.wait_for(reader.read(), 5)  # the server closes the idle one
            assert rest == b""
            body = await stream.read()  # while the stream in flight finishes
            await asyncio.wait_for(stopping, 5)
        writer.close()
    assert body.endswith(b"data: [DONE]\n\n")


async def test_shutdown_cuts_streams_that_outlive_the_grace_period() -> None:
    """The stream is held until ``fake.release``, which never comes: the shutdown ending at
    all is the grace period cutting it (that a stream within the grace is let finish is
    ``test_shutdown_lets_in_flight_streams_finish_and_refuses_new_work``)."""
    fake = FakeBackend(behaviour=stream_chat(10, hold_after=2))
    async with (
        running_fake(fake),
        running_gateway([fake.url], shutdown_grace=0.3) as gw,
        aiohttp.ClientSession() as s,
    ):
        r = await s.post(gw.url + "/v1/chat/completions", json=CHAT)
        await wait_for(lambda: fake.active() == 1, what="stream running")
        await stop_gracefully(gw.svc, gw.server, [])
        assert not fake.release.is_set()
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
        await wait_for(lambda: fake.active() == 0, what="upstream closed")


async def test_sigterm_during_load_finishes_streams_then_exits() -> None:
    fake = FakeBackend(behaviour=stream_chat(15, delay=0.03))
    async with running_fake(fake), aiohttp.ClientSession() as s:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env |= {"GATEWAY_BACKENDS": fake.url, "GATEWAY_LOG_FORMAT": "json"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--port",
            "0",
            env=env,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stderr is not None
        url = None
        while url is None:
            line = (await asyncio.wait_for(proc.stderr.readline(), 20)).decode()
            assert line, "gateway exited before listening"
            m = re.search(r'"address": ?"(http://127\.0\.0\.1:\d+)"', line)
            url = m.group(1) if m else None
        async with s.get(url + "/ready") as r:
            ready_status = r.status
        streams = [await s.post(url + "/v1/chat/completions", json=CHAT) for _ in range(4)]
        proc.send_signal(signal.SIGTERM)
        bodies = [await r.read() for r in streams]
        refused: Any = None
        try:
            async with aiohttp.ClientSession() as fresh:
                await fresh.post(url + "/v1/chat/completions", json=CHAT)
        except aiohttp.ClientConnectionError as exc:
            refused = exc
        code = await asyncio.wait_for(proc.wait(), 10)
    assert ready_status == 200
    assert all(b.endswith(b"data: [DONE]\n\n") and b'"error"' not in b for b in bodies)
    assert refused is not None
    assert code == 0
