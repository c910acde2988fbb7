"""Backends that die, hang, come back or fail: nothing is lost that could have been saved."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
from aiohttp import web

from backends.circuit import Circuit
from backends.health import Health
from gateway.keys import POOL
from tests.helpers import (
    FakeBackend,
    Seen,
    hung_server,
    kill,
    running_fake,
    running_gateway,
    stream_chat,
    wait_for,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def stream(s: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    async with s.post(url + "/v1/chat/completions", json=CHAT) as r:
        return r.status, await asyncio.wait_for(r.read(), 10)


def backend_state(gw: Any, fake_url: str) -> Any:
    b = gw.app[POOL].get(fake_url[7:])
    assert b is not None
    return b


async def test_backend_killed_mid_load() -> None:
    """Unstarted requests complete elsewhere; running streams end with an error event."""
    a = FakeBackend(behaviour=stream_chat(30, delay=0.02))
    b = FakeBackend(behaviour=stream_chat(30, delay=0.02))
    async with (
        running_fake(a),
        running_fake(b),
        running_gateway([a.url, b.url], health={"interval": 0.05, "fall": 2}) as gw,
        aiohttp.ClientSession() as s,
    ):
        first = [asyncio.create_task(stream(s, gw.url)) for _ in range(10)]
        await wait_for(lambda: a.active() >= 2 and b.active() >= 2, what="streams on both")
        running_on_a = a.active()
        await kill(a)
        # Requests sent now either fail over (connection refused) or avoid a at once.
        later = [asyncio.create_task(stream(s, gw.url)) for _ in range(10)]
        done_first = await asyncio.gather(*first)
        done_later = await asyncio.gather(*later)
        await wait_for(
            lambda: backend_state(gw, a.url).health.state is Health.DOWN, what="a marked down"
        )
        seen_on_a = len(a.seen)
        after = await asyncio.gather(*(stream(s, gw.url) for _ in range(10)))

    cut = [body for status, body in done_first if b'"error"' in body]
    assert len(cut) == running_on_a  # every stream that was running on a, and only those
    for body in cut:
        assert body.endswith(b"data: [DONE]\n\n")
        assert json.loads(body.split(b"\n\n")[-3][6:])["error"]["type"] == "bad_gateway"
    for status, body in done_later + after:
        assert status == 200
        assert body.endswith(b"data: [DONE]\n\n")
        assert b'"error"' not in body
    assert len(a.seen) == seen_on_a  # nothing sent to a once the probe marked it down
    assert set(gw.in_flight().values()) <= {0}


async def test_server_that_never_answers_gets_no_traffic() -> None:
    b = FakeBackend()
    async with (
        hung_server() as hung_url,
        running_fake(b),
        running_gateway([hung_url, b.url], health={"timeout": 0.2}) as gw,
        aiohttp.ClientSession() as s,
    ):
        # Its first probe timed out: it is down before it could take a request.
        assert backend_state(gw, hung_url).health.state is Health.DOWN
        for _ in range(5):
            async with s.post(gw.url + "/v1/completions", json={"model": "m"}) as r:
                assert r.status == 200
    assert len(b.seen) == 5


async def test_backend_that_hangs_is_marked_down_and_its_requests_fail_over() -> None:
    async def hang(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        await fake.release.wait()

    a = FakeBackend(behaviour=stream_chat(3))
    b = FakeBackend(behaviour=stream_chat(3))
    async with (
        running_fake(a),
        running_fake(b),
        running_gateway(
            [a.url, b.url],
            health={"interval": 0.05, "timeout": 0.2, "fall": 2},
            upstream={"idle_timeout": 0.3},
            policy="round_robin",
        ) as gw,
        aiohttp.ClientSession() as s,
    ):
        state = backend_state(gw, a.url)
        assert state.health.state is Health.UP
        a.behaviour, a.health_hangs = hang, True  # the engine hangs: accepts, never answers
        started = time.monotonic()
        results = await asyncio.gather(*(stream(s, gw.url) for _ in range(6)))
        took = time.monotonic() - started
        await wait_for(lambda: state.health.state is Health.DOWN, what="hung backend down")
        hung_requests = len(a.seen)
        again = await asyncio.gather(*(stream(s, gw.url) for _ in range(6)))
        assert state.health.last_error is not None
        a.release.set()
    assert all(status == 200 and body.endswith(b"[DONE]\n\n") for status, body in results)
    assert all(status == 200 for status, _ in again)
    assert took < 0.3 + 1.0  # one first-byte deadline plus a backoff, not a hang
    assert len(a.seen) == hung_requests  # nothing more once it was down


async def test_backend_coming_back_gets_traffic_only_after_rise_probes() -> None:
    a, b = FakeBackend(), FakeBackend()
    async with (
        running_fake(a),
        running_fake(b),
        running_gateway([a.url, b.url], health={"interval": 0.05, "fall": 1, "rise": 3}) as gw,
        aiohttp.ClientSession() as s,
    ):
        a.health_status = 503
        state = backend_state(gw, a.url)
        await wait_for(lambda: state.health.state is Health.DOWN, what="a down")
        a.seen.clear()
        a.health_status = 200
        ok_probes_before = sum(1 for _, st in a.probes if st == 200)
        sent_while_waiting = 0
        while state.health.state is not Health.UP:
            async with s.post(gw.url + "/v1/completions", json={"model": "m"}) as r:
                assert r.status == 200
            sent_while_waiting += 1
        ok_probes = [t for t, st in a.probes if st == 200][ok_probes_before:]
        assert len(ok_probes) >= 3
        for _ in range(20):
            async with s.post(gw.url + "/v1/completions", json={"model": "m"}) as r:
                assert r.status == 200
    assert sent_while_waiting > 0
    assert len(a.seen) > 0
    assert a.seen[0].started_at >= ok_probes[2]


async def test_circuit_opens_on_5xx_and_traffic_moves_to_the_healthy_backend() -> None:
    async def broken(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        return web.json_response({"error": {"message": "engine died"}}, status=500)

    bad, good = FakeBackend(behaviour=broken), FakeBackend()
    async with (
        running_fake(bad),
        running_fake(good),
        running_gateway(
            [bad.url, good.url],
            policy="round_robin",
            health={"circuit_threshold": 3, "circuit_cooldown": 60},
        ) as gw,
        aiohttp.ClientSession() as s,
    ):
        statuses = []
        for _ in range(20):
            async with s.post(gw.url + "/v1/completions", json={"model": "m"}) as r:
                statuses.append(r.status)
        circuit = backend_state(gw, bad.url).circuit
    assert circuit.state is Circuit.OPEN
    assert len(bad.seen) == 3  # then the circuit kept it out
    assert statuses.count(500) == 3  # a 500 is passed through, not retried
    assert statuses.count(200) == 17


async def test_retryable_status_fails_over_before_the_first_byte() -> None:
    async def full(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        return web.json_response({"error": {"message": "queue full"}}, status=503)

    busy, ok = FakeBackend(behaviour=full), FakeBackend()
    async with (
        running_fake(busy),
        running_fake(ok),
        running_gateway([busy.url, ok.url], policy="round_robin") as gw,
        aiohttp.ClientSession() as s,
    ):
        for _ in range(6):
            async with s.post(gw.url + "/v1/completions", json={"model": "m"}) as r:
                assert r.status == 200
        assert set(gw.in_flight().values()) == {0}
    assert len(busy.seen) >= 3
    assert len(ok.seen) == 6


async def test_all_attempts_failing_returns_the_last_error() -> None:
    async def full(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        return web.json_response({"error": {"message": "queue full"}}, status=503)

    x, y = FakeBackend(behaviour=full), FakeBackend(behaviour=full)
    async with (
        running_fake(x),
        running_fake(y),
        running_gateway([x.url, y.url], retry={"max_attempts": 2}) as gw,
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/completions", json={"model": "m"}) as r,
    ):
        body = await r.json()
        # Two backends, two attempts: the last one's answer is passed through as it was.
        assert r.status == 503
        assert body["error"]["message"] == "queue full"
    assert len(x.seen) + len(y.seen) == 2
