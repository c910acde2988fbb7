"""Sleep mode as vLLM 0.32 has it: dev-mode routes, levels, pause modes, queued requests,
the sleep-state gauge and the GPU memory sleeping frees."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import wait_for
from tools.sim import FAST, RunningSim, SimConfig, running_sim
from tools.sim.cli import add_arguments, config_from_args
from tools.sim.sleep import GIB, Sleep, SleepRequest, parse_sleep, parse_tags
from tools.sim.validation import BodyError

from .conftest import chat_body, completion_body, sse_events

DEV = FAST.replace(dev_mode=True, wake_time=0.01, wake_time_level2=0.03)
LONG: dict[str, Any] = {"max_tokens": 4000, "ignore_eos": True}
MODEL = {"model_name": FAST.model_name}


@pytest.fixture
async def sim() -> AsyncIterator[RunningSim]:
    async with running_sim(DEV) as s:
        yield s


async def post(client: aiohttp.ClientSession, url: str, **params: Any) -> tuple[int, bytes]:
    async with client.post(url, params=params) as resp:
        return resp.status, await resp.read()


async def is_sleeping(client: aiohttp.ClientSession, sim: RunningSim) -> bool:
    async with client.get(f"{sim.url}/is_sleeping") as resp:
        assert resp.status == 200
        doc = await resp.json()
    assert set(doc) == {"is_sleeping"}
    answer: bool = doc["is_sleeping"]
    return answer


async def metrics(client: aiohttp.ClientSession, sim: RunningSim) -> dict[tuple[str, str], float]:
    """Every sample, keyed by name and its labels (sorted, as ``k=v`` joined by commas)."""
    async with client.get(f"{sim.url}/metrics") as resp:
        text = await resp.text()
    return {
        (s.name, ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(m: dict[tuple[str, str], float], name: str, **labels: str) -> float:
    return m[(name, ",".join(f"{k}={v}" for k, v in sorted(labels.items())))]


def sleep_states(m: dict[tuple[str, str], float]) -> dict[str, float]:
    return {
        state: sample(m, "vllm:engine_sleep_state", **MODEL, engine="0", sleep_state=state)
        for state in ("awake", "weights_offloaded", "discard_all")
    }


# -- the routes


async def test_routes_are_absent_without_dev_mode(client: aiohttp.ClientSession) -> None:
    async with running_sim(FAST) as plain:
        for path in ("/sleep", "/wake_up"):
            async with client.post(f"{plain.url}{path}") as resp:
                assert resp.status == 404
                assert await resp.json() == {"detail": "Not Found"}
        async with client.get(f"{plain.url}/is_sleeping") as resp:
            assert resp.status == 404
        m = await metrics(client, plain)
    assert sleep_states(m) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    assert not any(name.startswith("vllm:sleep_mode_") for name, _ in m)


async def test_sleep_then_is_sleeping_until_wake_up(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    assert not await is_sleeping(client, sim)
    assert await post(client, f"{sim.url}/sleep") == (200, b"")
    assert await is_sleeping(client, sim)
    async with client.get(f"{sim.url}/health") as resp:
        assert resp.status == 200  # vLLM's /health does not mind sleep
    assert await post(client, f"{sim.url}/wake_up") == (200, b"")
    assert not await is_sleeping(client, sim)


@pytest.mark.parametrize(
    ("params", "param", "kind"),
    [
        ({"level": "3"}, "query.level", "less_than_equal"),
        ({"level": "-1"}, "query.level", "greater_than_equal"),
        ({"level": "deep"}, "query.level", "int_parsing"),
        ({"mode": "nap"}, "query.mode", "literal_error"),
    ],
)
async def test_a_bad_level_or_mode_is_vllms_400(
    sim: RunningSim,
    client: aiohttp.ClientSession,
    params: dict[str, str],
    param: str,
    kind: str,
) -> None:
    async with client.post(f"{sim.url}/sleep", params=params) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["type"] == "Bad Request"
    assert error["code"] == 400
    assert error["param"] == param
    assert error["message"].startswith("1 validation error:")
    assert f"'type': '{kind}'" in error["message"]
    assert not await is_sleeping(client, sim)


# -- requests while asleep


async def test_a_request_sent_while_asleep_is_queued_then_answered_after_wake_up(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    assert await post(client, f"{sim.url}/sleep", level="1") == (200, b"")
    task = asyncio.create_task(
        client.post(f"{sim.url}/v1/completions", json=completion_body(max_tokens=5))
    )
    await wait_for(lambda: len(sim.engine.waiting) == 1, what="queued while asleep")
    m = await metrics(client, sim)
    assert sample(m, "vllm:num_requests_waiting", **MODEL, engine="0") == 1
    assert sample(m, "vllm:num_requests_running", **MODEL, engine="0") == 0
    assert not task.done()
    assert await post(client, f"{sim.url}/wake_up") == (200, b"")
    async with await task as resp:
        assert resp.status == 200
        doc = await resp.json()
    assert doc["usage"]["completion_tokens"] == 5
    assert doc["choices"][0]["finish_reason"] == "length"


async def test_mode_abort_ends_in_flight_requests_with_abort(
    client: aiohttp.ClientSession,
) -> None:
    async with running_sim(DEV.replace(max_num_seqs=1)) as sim:
        url = f"{sim.url}/v1/chat/completions"
        async with client.post(url, json=chat_body(stream=True, **LONG)) as stream:
            await stream.content.readuntil(b"\n\n")  # decoding
            queued = asyncio.create_task(client.post(url, json=chat_body(**LONG)))
            queued_stream = asyncio.create_task(client.post(url, json=chat_body(stream=True)))
            await wait_for(lambda: len(sim.engine.waiting) == 2, what="two queued")
            assert await post(client, f"{sim.url}/sleep", mode="abort") == (200, b"")
            events = sse_events(await stream.read())
        assert events[-1] == "[DONE]"
        last = events[-2]["choices"][0]
        assert last["finish_reason"] == "abort"
        assert last["delta"] == {"content": ""}
        async with await queued_stream as resp:  # aborted before its first token
            events = sse_events(await resp.read())
        deltas = [e["choices"][0]["delta"] for e in events[:-1]]
        assert deltas == [{"role": "assistant", "content": ""}, {"content": ""}]
        assert events[-2]["choices"][0]["finish_reason"] == "abort"
        async with await queued as resp:
            assert resp.status == 200
            doc = await resp.json()
        assert doc["choices"][0]["finish_reason"] == "abort"
        assert doc["usage"]["completion_tokens"] == 0
        assert not sim.engine.has_work()
        assert sim.engine.stats.aborted["decode"] == 1
        assert sim.engine.stats.aborted["queued"] == 2


async def test_mode_wait_lets_running_requests_finish_then_sleeps(
    client: aiohttp.ClientSession,
) -> None:
    async with running_sim(DEV.replace(max_num_seqs=1)) as sim:
        url = f"{sim.url}/v1/completions"
        running = asyncio.create_task(
            client.post(url, json=completion_body(max_tokens=300, ignore_eos=True))
        )
        await wait_for(lambda: sim.engine.stats.generation_tokens > 0, what="decoding")
        queued = asyncio.create_task(client.post(url, json=completion_body(max_tokens=3)))
        await wait_for(lambda: len(sim.engine.waiting) == 1, what="one queued")
        assert await post(client, f"{sim.url}/sleep", mode="wait") == (200, b"")
        # Asleep only once the running request had finished, whole; the queued one waits.
        assert sim.engine.stats.request_success["length"] == 1
        assert sum(sim.engine.stats.aborted.values()) == 0
        assert len(sim.engine.waiting) == 1
        assert not sim.engine.running
        async with await running as resp:
            doc = await resp.json()
        assert doc["usage"]["completion_tokens"] == 300
        assert doc["choices"][0]["finish_reason"] == "length"
        assert not queued.done()
        assert await post(client, f"{sim.url}/wake_up") == (200, b"")
        async with await queued as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 3


async def test_mode_wait_is_sleeping_from_the_pause_on(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    """As vLLM's: the scheduler is paused at once, so ``is_sleeping`` is true while the
    running requests drain; the sleep answers once they are gone."""
    url = f"{sim.url}/v1/completions"
    stream = await client.post(url, json=completion_body(stream=True, **LONG))
    await stream.content.readuntil(b"\n\n")  # decoding
    sleeping = asyncio.create_task(post(client, f"{sim.url}/sleep", mode="wait"))
    await wait_for(lambda: sim.engine.pause == "paused_new", what="paused")
    assert await is_sleeping(client, sim)
    assert not sleeping.done()
    stream.close()  # the client gives up: its request is aborted, nothing runs any more
    assert await sleeping == (200, b"")
    assert sim.engine.stats.aborted["decode"] == 1


@pytest.mark.parametrize("level", [0, 1])
async def test_mode_keep_pauses_requests_which_go_on_after_wake_up(
    client: aiohttp.ClientSession, level: int
) -> None:
    async with running_sim(DEV.replace(max_num_seqs=1)) as sim:
        url = f"{sim.url}/v1/completions"
        body = completion_body(stream=True, max_tokens=40, ignore_eos=True)
        async with client.post(url, json=body) as stream:
            first = await stream.content.readuntil(b"\n\n")  # decoding
            queued = asyncio.create_task(client.post(url, json=completion_body(max_tokens=3)))
            await wait_for(lambda: len(sim.engine.waiting) == 1, what="one queued")
            asleep = await post(client, f"{sim.url}/sleep", level=str(level), mode="keep")
            assert asleep == (200, b"")
            assert sim.engine.pause == "paused_all"
            assert not sim.engine.has_unfinished()  # nothing steps while asleep
            assert sum(sim.engine.stats.aborted.values()) == 0
            if level == 0:  # the request keeps its place and its KV cache
                assert len(sim.engine.running) == 1
                assert sim.engine.pool.usage > 0
            else:  # the KV cache is gone: the request will be recomputed
                assert not sim.engine.running
                assert len(sim.engine.waiting) == 2
                assert sim.engine.pool.usage == 0
                assert sim.engine.stats.num_preemptions == 1
            assert await post(client, f"{sim.url}/wake_up") == (200, b"")
            events = sse_events(first + await stream.read())
        tokens = [e for e in events if e != "[DONE]"]
        assert len(tokens) == 40
        assert tokens[-1]["choices"][0]["finish_reason"] == "length"
        async with await queued as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 3


# -- waking


async def test_wake_up_takes_its_level_wake_time(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    waited: list[float] = []

    async def record(seconds: float) -> None:
        waited.append(seconds)

    sim.state.sleep.wait = record
    for level in ("1", "2", "0"):
        assert await post(client, f"{sim.url}/sleep", level=level) == (200, b"")
        assert await post(client, f"{sim.url}/wake_up") == (200, b"")
    assert waited == [DEV.wake_time, DEV.wake_time_level2]  # level 0 wakes at once


async def test_is_sleeping_while_a_wake_is_under_way(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    gate = asyncio.Event()

    async def held(seconds: float) -> None:
        await gate.wait()

    sim.state.sleep.wait = held
    assert await post(client, f"{sim.url}/sleep") == (200, b"")
    waking = asyncio.create_task(post(client, f"{sim.url}/wake_up"))
    await wait_for(lambda: sim.state.sleep.waking, what="waking")
    assert await is_sleeping(client, sim)
    request = asyncio.create_task(
        client.post(f"{sim.url}/v1/completions", json=completion_body(max_tokens=2))
    )
    await wait_for(lambda: len(sim.engine.waiting) == 1, what="queued while waking")
    m = await metrics(client, sim)
    assert sample(m, "vllm:sleep_mode_operations_in_flight", operation="wake") == 1
    gate.set()
    assert await waking == (200, b"")
    assert not await is_sleeping(client, sim)
    async with await request as resp:
        assert resp.status == 200


async def test_partial_wake_up_keeps_requests_queued_until_fully_awake(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    assert await post(client, f"{sim.url}/sleep", level="1") == (200, b"")
    task = asyncio.create_task(
        client.post(f"{sim.url}/v1/completions", json=completion_body(max_tokens=2))
    )
    await wait_for(lambda: len(sim.engine.waiting) == 1, what="queued")
    assert await post(client, f"{sim.url}/wake_up", tags="weights") == (200, b"")
    assert await is_sleeping(client, sim)  # the KV cache is still asleep
    assert len(sim.engine.waiting) == 1
    m = await metrics(client, sim)
    # vLLM records "awake" after any wake_up, even a partial one
    assert sleep_states(m)["awake"] == 1
    assert sample(m, "sim:gpu_memory_used_bytes", **MODEL) == round(DEV.gpu_memory_gib * GIB)
    assert await post(client, f"{sim.url}/wake_up", tags="kv_cache") == (200, b"")
    assert not await is_sleeping(client, sim)
    async with await task as resp:
        assert resp.status == 200


# -- metrics


async def test_sleep_state_gauge_follows_each_sleep_and_wake(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    awake = {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    assert sleep_states(await metrics(client, sim)) == awake
    expected = {
        "1": {"awake": 0, "weights_offloaded": 1, "discard_all": 0},
        "2": {"awake": 0, "weights_offloaded": 0, "discard_all": 1},
        "0": {"awake": 0, "weights_offloaded": 0, "discard_all": 0},  # as vLLM records it
    }
    for level, states in expected.items():
        assert await post(client, f"{sim.url}/sleep", level=level) == (200, b"")
        assert sleep_states(await metrics(client, sim)) == states
        assert await post(client, f"{sim.url}/wake_up") == (200, b"")
        assert sleep_states(await metrics(client, sim)) == awake
    m = await metrics(client, sim)
    for op in ("sleep", "wake"):
        count = sample(m, "vllm:sleep_mode_operation_duration_seconds_count", operation=op)
        assert count == 3
        inf = sample(
            m, "vllm:sleep_mode_operation_duration_seconds_bucket", operation=op, le="+Inf"
        )
        assert inf == 3
        assert sample(m, "vllm:sleep_mode_operations_in_flight", operation=op) == 0


async def test_sim_state_lists_the_sleep_operations_in_the_order_they_ran(
    client: aiohttp.ClientSession,
) -> None:
    headers = {"Authorization": "Bearer t"}
    async with running_sim(DEV.replace(admin_token="t")) as sim:
        for path in ("/sleep", "/sleep", "/wake_up"):
            assert await post(client, f"{sim.url}{path}") == (200, b"")
        async with client.get(f"{sim.url}/sim/state", headers=headers) as resp:
            doc = await resp.json()
    assert doc["sleep"]["operations"] == ["sleep", "sleep", "wake"]


async def test_gpu_memory_drops_while_asleep(client: aiohttp.ClientSession) -> None:
    config = DEV.replace(gpu_memory_gib=10.0, num_gpu_blocks_override=1024, block_size=16)
    kv_cache = 1024 * 16 * 512 * 1024  # 512 KiB per token: 8 GiB
    weights = 10 * GIB
    expected = {  # level: (GPU, CPU) while asleep
        "0": (weights + kv_cache, 0),
        "1": (0, weights),  # weights offloaded to CPU memory, KV cache dropped
        "2": (0, 0),  # everything dropped
    }
    async with running_sim(config) as sim:

        async def memory() -> tuple[float, float]:
            m = await metrics(client, sim)
            return (
                sample(m, "sim:gpu_memory_used_bytes", **MODEL),
                sample(m, "sim:cpu_memory_offloaded_bytes", **MODEL),
            )

        assert await memory() == (weights + kv_cache, 0)
        for level, asleep in expected.items():
            assert await post(client, f"{sim.url}/sleep", level=level) == (200, b"")
            assert await memory() == asleep
            assert await post(client, f"{sim.url}/wake_up") == (200, b"")
            assert await memory() == (weights + kv_cache, 0)


async def test_level_1_empties_the_prefix_cache(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = completion_body("w " * 64, max_tokens=2)
    async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
    assert sim.engine.pool.num_cached > 0
    assert await post(client, f"{sim.url}/sleep", level="0") == (200, b"")
    assert sim.engine.pool.num_cached > 0  # level 0 only pauses
    assert await post(client, f"{sim.url}/sleep", level="1") == (200, b"")
    assert sim.engine.pool.num_cached == 0


# -- the state machine and the options, without I/O


def test_parse_sleep_defaults_and_values() -> None:
    assert parse_sleep({}) == SleepRequest(level=1, mode="abort")
    assert parse_sleep({"level": "2", "mode": "keep"}) == SleepRequest(level=2, mode="keep")
    with pytest.raises(BodyError) as caught:
        parse_sleep({"level": "3", "mode": "nap"})
    assert caught.value.message.startswith("2 validation errors:")
    assert parse_tags([]) is None
    assert parse_tags(["weights", "weights"]) == frozenset({"weights"})


def test_wake_up_tags_as_vllms_executor_takes_them() -> None:
    level1 = Sleep().pausing().slept(1)
    assert level1.is_sleeping
    assert level1.wake(None, DEV).after == Sleep()
    # "scheduling" alone wakes no memory: still asleep, scheduling stays paused
    assert level1.wake(frozenset({"scheduling"}), DEV).after.paused
    # a tag that is not asleep makes vLLM wake nothing at all
    assert not level1.wake(frozenset({"weights", "bogus"}), DEV).woken
    weights = level1.wake(frozenset({"weights"}), DEV)
    assert (weights.woken, weights.seconds) == (frozenset({"weights"}), DEV.wake_time)
    assert weights.after.is_sleeping
    assert not weights.after.wake(frozenset({"kv_cache"}), DEV).after.is_sleeping
    # level 0 has no memory asleep: any wake_up resumes scheduling at once
    level0 = Sleep().pausing().slept(0)
    assert level0.wake(frozenset({"weights"}), DEV) == level0.wake(None, DEV)
    assert not level0.wake(None, DEV).after.is_sleeping


def test_an_executor_asleep_stays_at_its_level() -> None:
    """vLLM's executor ignores a second sleep; its gauge records the level asked."""
    state = Sleep().pausing().slept(1).pausing().slept(2)
    assert state.level == 1
    assert state.memory(DEV).cpu_offloaded == round(DEV.gpu_memory_gib * GIB)
    assert state.gauge() == {"awake": 0, "weights_offloaded": 0, "discard_all": 1}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_dev_mode_defaults_to_vllms_environment_variable() -> None:
    assert not config_from_args(parse(), environ={}).dev_mode
    assert config_from_args(parse(), environ={"VLLM_SERVER_DEV_MODE": "1"}).dev_mode
    assert not config_from_args(parse(), environ={"VLLM_SERVER_DEV_MODE": "0"}).dev_mode
    assert config_from_args(parse("--dev-mode"), environ={}).dev_mode
    off = parse("--no-dev-mode")
    assert not config_from_args(off, environ={"VLLM_SERVER_DEV_MODE": "1"}).dev_mode
    with pytest.raises(ValueError, match="VLLM_SERVER_DEV_MODE must be an integer"):
        config_from_args(parse(), environ={"VLLM_SERVER_DEV_MODE": "yes"})


def test_sleep_options() -> None:
    args = parse(
        "--wake-time", "1.5", "--wake-time-level2", "9", "--gpu-memory-gib", "70",
        "--kv-cache-kib-per-token", "320",
    )  # fmt: skip
    config = config_from_args(args, environ={})
    assert (config.wake_time, config.wake_time_level2) == (1.5, 9.0)
    assert (config.gpu_memory_gib, config.kv_cache_kib_per_token) == (70.0, 320.0)
    with pytest.raises(ValueError, match="wake_time must not be negative"):
        SimConfig(wake_time=-1)
