"""Backends that die, hang, come back or fail: nothing is lost that could have been saved."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from backends.circuit import Circuit
from backends.health import Health
from loadtest.counting import counting
from tests.helpers import (
    FakeBackend,
    Seen,
    answer,
    events,
    hang_before_headers,
    hung_server,
    kill,
    running_fake,
    running_gateway,
    sample,
    stream_chat,
    wait_for,
)

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 30,
}


async def stream(s: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    async with s.post(url + "/v1/chat/completions", json=CHAT) as r:
        return r.status, await asyncio.wait_for(r.read(), 10)


def backend_state(gw: Any, fake_url: str) -> Any:
    b = gw.svc.pool.get(fake_url[7:])
    assert b is not None
    return b


async def test_backend_killed_mid_load() -> None:
    """Unstarted requests complete elsewhere; running streams go on from the other backend."""
    a = FakeBackend(behaviour=counting(delay=0.02))
    b = FakeBackend(behaviour=counting(delay=0.02))
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

        continued = sample(
            gw, "llm_gateway_stream_continuations_total", outcome="continued", reason="unreachable"
        )
    assert continued == running_on_a  # every stream that was running on a, and only those
    whole = "".join(f" w{i}" for i in range(30))
    for status, body in done_first + done_later + after:
        assert status == 200
        assert body.endswith(b"data: [DONE]\n\n")
        assert b'"error"' not in body
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events(body)[:-1])
        assert text == whole  # nothing lost, nothing repeated
    assert len(a.seen) == seen_on_a  # nothing sent to a once the probe marked it down
    assert set(gw.in_flight().values()) <= {0}


async def test_server_that_never_answers_gets_no_traffic() -> None:
    b = FakeBackend()
    async with (
        hung_server() as hung_url,
        running_fake(b),
        running_gateway([hung_url, b.url], health={"timeout": 0.2}, wait_models=False) as gw,
        aiohttp.ClientSession() as s,
    ):
        # Its first probe timed out: it is down before it could take a request.
        assert backend_state(gw, hung_url).health.state is Health.DOWN
        await wait_for(lambda: backend_state(gw, b.url).models_known, what="b's models")
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
        # "a" answers nothing until released, after the last request: those sent there end
        # whole only if the first-byte deadline (or its probes) took them elsewhere.
        results = await asyncio.gather(*(stream(s, gw.url) for _ in range(6)))
        await wait_for(lambda: state.health.state is Health.DOWN, what="hung backend down")
        hung_requests = len(a.seen)
        again = await asyncio.gather(*(stream(s, gw.url) for _ in range(6)))
        assert state.health.last_error is not None
        a.release.set()
    assert all(status == 200 and body.endswith(b"[DONE]\n\n") for status, body in results)
    assert all(status == 200 for status, _ in again)
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
    broken = answer(500, "engine died")

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
    full = answer(503, "queue full")

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
    full = answer(503, "queue full")

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


async def test_a_lone_busy_backends_answer_reaches_the_client_with_its_retry_after() -> None:
    """Issue 16.2: with no other backend to try, "503, retry in 7 s" is the client's answer,
    not a gateway error in its place (it was 502 "backend answered 503", no Retry-After)."""

    async def busy(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        return web.json_response(
            {"error": {"message": "queue full", "type": "ServiceUnavailable", "code": 503}},
            status=503,
            headers={"Retry-After": "7"},
        )

    throttled = answer(429, "slow down")

    a = FakeBackend(behaviour=busy)
    async with (
        running_fake(a),
        running_gateway([a.url], retry={"max_attempts": 3}) as gw,
        aiohttp.ClientSession() as s,
    ):
        async with s.post(gw.url + "/v1/completions", json={"model": "m"}) as r:
            assert r.status == 503
            assert r.headers["Retry-After"] == "7"
            assert (await r.json())["error"]["message"] == "queue full"
        a.behaviour = throttled
        async with s.post(gw.url + "/v1/completions", json={"model": "m"}) as r:
            assert r.status == 429
            assert r.headers["Retry-After"] == "1"  # the gateway's, since the backend gave none
            assert (await r.json())["error"]["message"] == "slow down"
        assert set(gw.in_flight().values()) == {0}
    assert len(a.seen) == 2  # one attempt each: no candidate was left to retry on


async def test_every_backend_busy_each_is_tried_once_and_the_last_answer_is_passed_on() -> None:
    async def busy(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        return web.json_response({"error": {"message": f"full {fake.url}"}}, status=503)

    fakes = [FakeBackend(behaviour=busy) for _ in range(3)]
    async with (
        running_fake(fakes[0]),
        running_fake(fakes[1]),
        running_fake(fakes[2]),
        running_gateway([f.url for f in fakes], retry={"max_attempts": 5}) as gw,
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/completions", json={"model": "m"}) as r,
    ):
        assert r.status == 503
        assert "Retry-After" in r.headers
        message = (await r.json())["error"]["message"]
    assert [len(f.seen) for f in fakes] == [1, 1, 1]
    (last,) = [f for f in fakes if f.seen[0].started_at == max(g.seen[0].started_at for g in fakes)]
    assert message == f"full {last.url}"


async def test_the_lease_is_released_before_the_retry_backoff() -> None:
    """Issue 16.8: the failed backend counted the request as in flight while it slept."""

    busy = answer(503, "full")

    a, b = FakeBackend(behaviour=busy), FakeBackend()
    async with (
        running_fake(a),
        running_fake(b),
        running_gateway(
            [a.url, b.url],
            policy="round_robin",
            retry={"backoff_base": 0.6, "jitter": 0.0},
        ) as gw,
        aiohttp.ClientSession() as s,
    ):
        request = asyncio.create_task(s.post(gw.url + "/v1/completions", json={"model": "m"}))
        await wait_for(lambda: bool(a.seen) and a.seen[0].ended_at is not None, what="a's 503")
        await wait_for(lambda: gw.in_flight()[a.url[7:]] == 0, within=0.3, what="a released")
        assert not b.seen  # still in the backoff
        async with await request as r:
            assert r.status == 200
    assert len(b.seen) == 1


async def test_a_request_waiting_on_a_backend_that_goes_down_moves_on_at_once() -> None:
    """Issue 16.13: it waited for the idle timeout (120 s) although the probes had marked the
    backend down seconds before; now it moves to another backend as soon as they do."""

    async def hang(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        await fake.release.wait()

    a, b = FakeBackend(behaviour=hang), FakeBackend(behaviour=stream_chat(3))
    async with (
        running_fake(a),
        running_fake(b),
        running_gateway(
            [a.url, b.url],
            policy="round_robin",
            health={"interval": 0.05, "timeout": 0.2, "fall": 2},
        ) as gw,
        aiohttp.ClientSession() as s,
    ):
        state = backend_state(gw, a.url)
        whole = asyncio.create_task(s.post(gw.url + "/v1/completions", json={"model": "m"}))
        await wait_for(lambda: len(a.seen) == 1, what="the first request on a")
        streamed = asyncio.create_task(stream(s, gw.url))  # round robin: to b
        third = asyncio.create_task(stream(s, gw.url))  # and a stream to a
        await wait_for(lambda: len(a.seen) == 2, what="the stream on a")
        a.health_hangs = True  # its probes start failing too
        async with await asyncio.wait_for(whole, 10) as r:
            assert r.status == 200
        statuses = [
            status for status, _ in await asyncio.wait_for(asyncio.gather(streamed, third), 10)
        ]
        assert state.health.state is Health.DOWN
        a.release.set()
    assert statuses == [200, 200]
    assert len(b.seen) == 3  # the two that waited on a, and the one sent to b
    assert all(seen.ending == "cancelled" for seen in a.seen)  # closed: vLLM would abort


async def test_a_request_with_nowhere_else_to_go_keeps_waiting_on_a_backend_marked_down() -> None:
    """The interrupt is only for requests another backend could take: a backend marked down
    may still answer (its probes time out under load), and a lone one is the only hope."""
    a = FakeBackend(behaviour=hang_before_headers)
    async with (
        running_fake(a),
        running_gateway([a.url], health={"interval": 0.05, "timeout": 0.2, "fall": 2}) as gw,
        aiohttp.ClientSession() as s,
    ):
        state = backend_state(gw, a.url)
        request = asyncio.create_task(s.post(gw.url + "/v1/completions", json={"model": "m"}))
        await wait_for(lambda: len(a.seen) == 1, what="the request on a")
        a.health_hangs = True
        await wait_for(lambda: state.health.state is Health.DOWN, what="a marked down")
        a.release.set()  # it answers after all
        async with await asyncio.wait_for(request, 10) as r:
            assert r.status == 200
            assert (await r.json()) == {"late": True}
