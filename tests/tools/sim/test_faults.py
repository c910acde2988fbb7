"""Faults on demand: each one, set in-process, at start, or through the admin endpoint."""

from __future__ import annotations

import asyncio
from typing import NoReturn

import aiohttp
import pytest

from tests.waiting import wait_for
from tools.sim import FAST, Faults, RunningSim, running_sim
from tools.sim.faults import FaultsError

from .conftest import assert_clean, chat_body, completion_body, sse_events

QUICK = aiohttp.ClientTimeout(total=0.3)


async def busy_time_of_one_request(sim: RunningSim, client: aiohttp.ClientSession) -> float:
    before = sim.engine.stats.busy_time
    body = completion_body(max_tokens=10, ignore_eos=True)
    async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
    return sim.engine.stats.busy_time - before


async def read_for(resp: aiohttp.ClientResponse, seconds: float) -> tuple[bytes, bool]:
    """What a response body delivers within ``seconds``, and whether it ended."""
    received = b""
    try:
        async with asyncio.timeout(seconds):
            async for chunk in resp.content.iter_any():
                received += chunk
    except TimeoutError:
        return received, False
    return received, True


async def test_slowdown_multiplies_simulated_step_time(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    normal = await busy_time_of_one_request(sim, client)
    sim.faults = Faults(slowdown=4.0)
    slow = await busy_time_of_one_request(sim, client)
    assert slow == pytest.approx(4 * normal)


async def test_error_rate_answers_with_the_chosen_status(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    sim.faults = Faults(error_rate=1.0, error_status=503)
    async with client.post(f"{sim.url}/v1/completions", json=completion_body()) as resp:
        assert resp.status == 503
        error = (await resp.json())["error"]
    assert error["code"] == 503
    assert error["type"] == "ServiceUnavailableError"
    assert sim.state.injected_errors == 1
    assert sim.engine.stats.prompt_tokens == 0  # the engine never saw it


async def test_partial_error_rate_fails_some_requests(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    sim.faults = Faults(error_rate=0.5)
    statuses = []
    for _ in range(40):
        async with client.post(f"{sim.url}/v1/completions", json=completion_body()) as resp:
            statuses.append(resp.status)
    assert set(statuses) == {200, 500}


async def test_hang_before_first_byte(sim: RunningSim, client: aiohttp.ClientSession) -> None:
    sim.faults = Faults(hang_before_first_byte=True)
    with pytest.raises(asyncio.TimeoutError):
        await client.post(f"{sim.url}/v1/completions", json=completion_body(), timeout=QUICK)
    assert sim.engine.stats.prompt_tokens == 0
    sim.faults = Faults()
    async with client.post(f"{sim.url}/v1/completions", json=completion_body()) as resp:
        assert resp.status == 200


async def test_hang_mid_stream_after_n_tokens(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    sim.faults = Faults(hang_after_tokens=3)
    body = completion_body(stream=True, max_tokens=20, ignore_eos=True)
    async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
        received, ended = await read_for(resp, 0.3)
    assert not ended
    events = sse_events(received)
    assert len(events) == 3
    assert "[DONE]" not in events
    # The client gave up: nothing is left of the request (here the engine had finished it).
    await wait_for(lambda: sim.state.in_flight == 0, within=10, what="handler gone")
    assert not sim.engine.running


async def read_until_reset(resp: aiohttp.ClientResponse) -> bytes:
    """What a response body delivers before its connection is reset (it must be)."""
    received = bytearray()

    async def read() -> None:
        async with asyncio.timeout(10):
            async for chunk in resp.content.iter_any():
                received.extend(chunk)

    with pytest.raises(aiohttp.ClientError):
        await read()
    return bytes(received)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_break_mid_stream_resets_the_connection_after_n_tokens(
    sim: RunningSim, client: aiohttp.ClientSession, path: str
) -> None:
    sim.faults = Faults(break_after_tokens=3)
    chat = path.endswith("chat/completions")
    body = (chat_body if chat else completion_body)(stream=True, max_tokens=20, ignore_eos=True)
    async with client.post(f"{sim.url}{path}", json=body) as resp:
        assert resp.status == 200
        received = await read_until_reset(resp)
    events = sse_events(received)
    assert len(events) == 3 + chat  # a chat's role chunk, then three tokens; no [DONE]
    assert "[DONE]" not in events
    await wait_for(lambda: sim.engine.stats.aborted["decode"] == 1, within=10, what="abort")
    assert_clean(sim)
    assert sim.state.in_flight == 0


async def test_error_mid_stream_sends_vllms_error_event_then_done(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    sim.faults = Faults(error_after_tokens=2)
    body = chat_body(stream=True, max_tokens=20, ignore_eos=True)
    body["stream_options"] = {"include_usage": True}
    async with client.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        raw = await resp.read()
    assert raw.endswith(
        b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
        b'"param": null, "code": 500}}\n\ndata: [DONE]\n\n'
    )
    role, *tokens, error, done = sse_events(raw)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None, None]  # and no usage
    assert error["error"]["code"] == 500
    assert done == "[DONE]"
    await wait_for(lambda: sim.engine.stats.aborted["decode"] == 1, within=10, what="abort")
    assert_clean(sim)
    assert sim.state.in_flight == 0


async def test_a_stream_fault_set_at_run_time_hits_streams_already_past_it(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = completion_body(stream=True, max_tokens=4000, ignore_eos=True)
    async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
        received = b""
        while received.count(b"\n\n") < 5:
            received += await resp.content.readuntil(b"\n\n")
        sim.faults = Faults(break_after_tokens=2)
        received += await read_until_reset(resp)
    events = sse_events(received)
    assert 5 <= len(events) < 4000
    assert "[DONE]" not in events
    await wait_for(lambda: sim.engine.stats.aborted["decode"] == 1, within=10, what="abort")
    assert_clean(sim)


async def test_stream_faults_leave_short_streams_and_non_streams_alone(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    sim.faults = Faults(break_after_tokens=3, error_after_tokens=3)
    body = completion_body(stream=True, max_tokens=3, ignore_eos=True)
    async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
        events = sse_events(await resp.read())
    assert len(events) == 3 + 1  # every token, then [DONE]: the fault would hit a fourth
    body = completion_body(max_tokens=10, ignore_eos=True)
    async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
        assert (await resp.json())["usage"]["completion_tokens"] == 10


def test_the_first_stream_fault_reached_stops_the_stream() -> None:
    faults = Faults(hang_after_tokens=2, error_after_tokens=5, break_after_tokens=5)
    assert [faults.stream_stop(n) for n in (0, 1, 2, 5)] == [None, None, "hang", "break"]
    assert Faults(error_after_tokens=0).stream_stop(0) == "error"
    assert Faults().stream_stop(10**6) is None


async def test_refuse_connections_then_accept_again_on_the_same_port(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    port = sim.port
    await sim.set_faults(Faults(refuse_connections=True))
    async with aiohttp.ClientSession() as fresh:
        with pytest.raises(aiohttp.ClientConnectorError):
            await fresh.get(f"{sim.url}/health")
    await sim.set_faults(Faults())
    assert sim.port == port
    async with client.get(f"{sim.url}/health") as resp:
        assert resp.status == 200


async def test_refuse_connections_drops_existing_keep_alive_connections(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    async with client.get(f"{sim.url}/health") as resp:
        assert resp.status == 200  # the connection is now pooled
    await sim.set_faults(Faults(refuse_connections=True))
    with pytest.raises(aiohttp.ClientError):
        await client.get(f"{sim.url}/health")


async def test_unhealthy_fails_health_checks_only(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    sim.faults = Faults(unhealthy=True)
    for path in ("/health", "/ping"):
        async with client.get(f"{sim.url}{path}") as resp:
            assert resp.status == 503
    async with client.post(f"{sim.url}/v1/completions", json=completion_body()) as resp:
        assert resp.status == 200


async def test_startup_delay_binds_the_socket_but_answers_nothing(
    client: aiohttp.ClientSession,
) -> None:
    async with running_sim(FAST.replace(startup_delay_s=0.5)) as sim:
        with pytest.raises(asyncio.TimeoutError):
            await client.get(f"{sim.url}/health", timeout=aiohttp.ClientTimeout(total=0.1))
        pending = asyncio.create_task(client.get(f"{sim.url}/health"))
        await sim.state.ready.wait()
        async with await pending as resp:
            assert resp.status == 200  # a request made while loading is answered after


async def test_faults_given_at_start(client: aiohttp.ClientSession) -> None:
    async with running_sim(FAST, faults=Faults(unhealthy=True, slowdown=2.0)) as sim:
        assert sim.driver.slowdown == 2.0
        async with client.get(f"{sim.url}/health") as resp:
            assert resp.status == 503


def test_faults_patches_are_validated() -> None:
    assert Faults().updated({"slowdown": 3, "hang_after_tokens": None}).slowdown == 3.0
    patched = Faults().updated({"break_after_tokens": 4, "error_after_tokens": 0})
    assert (patched.break_after_tokens, patched.error_after_tokens) == (4, 0)
    for bad in (
        {"slowdown": 0},
        {"nope": 1},
        {"unhealthy": 1},
        {"error_status": 200},
        {"hang_after_tokens": -1},
        {"break_after_tokens": -1},
        {"error_after_tokens": -1},
        {"break_after_tokens": 2.0},
        {"error_after_tokens": True},
    ):
        with pytest.raises(FaultsError):
            Faults().updated(bad)


async def test_admin_endpoint_is_absent_without_a_token(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    for method in ("GET", "PUT"):
        async with client.request(method, f"{sim.url}/sim/faults", json={}) as resp:
            assert resp.status in (404, 405)
    async with client.get(f"{sim.url}/sim/state") as resp:
        assert resp.status == 404


async def test_admin_endpoint_changes_faults_with_the_token(
    client: aiohttp.ClientSession,
) -> None:
    async with running_sim(FAST.replace(admin_token="s3cret")) as sim:
        url = f"{sim.url}/sim/faults"
        auth = {"Authorization": "Bearer s3cret"}
        async with client.put(url, json={"slowdown": 3}) as resp:
            assert resp.status == 401
        async with client.put(
            url, json={"slowdown": 3}, headers={"Authorization": "Bearer x"}
        ) as resp:
            assert resp.status == 401
        assert sim.faults == Faults()
        async with client.put(url, json={"slowdown": 3, "unhealthy": True}, headers=auth) as r:
            assert r.status == 200
            assert (await r.json())["slowdown"] == 3.0
        assert sim.faults == Faults(slowdown=3.0, unhealthy=True)
        assert sim.driver.slowdown == 3.0
        async with client.get(url, headers=auth) as resp:
            assert (await resp.json())["unhealthy"] is True
        async with client.put(url, json={"bogus": 1}, headers=auth) as resp:
            assert resp.status == 400
        mid_stream = {"break_after_tokens": 7, "error_after_tokens": 9}
        async with client.put(url, json=mid_stream, headers=auth) as resp:
            assert resp.status == 200
            assert (await resp.json())["break_after_tokens"] == 7
        assert (sim.faults.break_after_tokens, sim.faults.error_after_tokens) == (7, 9)
        async with client.put(url, json={"error_after_tokens": -2}, headers=auth) as resp:
            assert resp.status == 400
            assert "must not be negative" in (await resp.json())["error"]["message"]
        async with client.put(url, json={"reset": True}, headers=auth) as resp:
            assert resp.status == 200
        assert sim.faults == Faults()
        async with client.get(f"{sim.url}/sim/state", headers=auth) as resp:
            state = await resp.json()
        assert {"running", "waiting", "kv_cache_usage", "clock_lag_seconds"} <= set(state)


async def test_admin_faults_can_revert_by_themselves(client: aiohttp.ClientSession) -> None:
    async with running_sim(FAST.replace(admin_token="t")) as sim:
        body = {"refuse_connections": True, "revert_after": 0.2}
        async with client.put(
            f"{sim.url}/sim/faults", json=body, headers={"Authorization": "Bearer t"}
        ) as resp:
            assert resp.status == 200
        assert sim.faults.refuse_connections
        await wait_for(lambda: not sim.faults.refuse_connections, within=10, what="revert")
        async with aiohttp.ClientSession() as fresh:
            await wait_for(lambda: sim.listening, within=10, what="listening again")
            async with fresh.get(f"{sim.url}/health") as resp:
                assert resp.status == 200


async def test_a_dead_engine_loop_makes_health_fail(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    def broken_step(now: float, slowdown: float = 1.0) -> NoReturn:
        raise RuntimeError("simulated engine bug")

    sim.engine.step = broken_step  # type: ignore[method-assign]
    with pytest.raises(asyncio.TimeoutError):
        await client.post(f"{sim.url}/v1/completions", json=completion_body(), timeout=QUICK)
    await wait_for(lambda: sim.state.engine_dead, within=10, what="engine death noticed")
    async with client.get(f"{sim.url}/health") as resp:
        assert resp.status == 503
