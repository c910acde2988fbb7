"""A client that goes away aborts its request in every phase, frees its slot and blocks,
and is counted by phase, never in vllm:request_success."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest

from tests.waiting import wait_for
from tools.sim import FAST, Faults, RunningSim, running_sim

from .conftest import assert_clean, chat_body, completion_body

LONG: dict[str, Any] = {"max_tokens": 4000, "ignore_eos": True}


async def test_disconnect_while_queued(client: aiohttp.ClientSession) -> None:
    async with running_sim(FAST.replace(max_num_seqs=1)) as sim:
        body = completion_body(stream=True, **LONG)
        running = await client.post(f"{sim.url}/v1/completions", json=body)
        queued = await client.post(f"{sim.url}/v1/completions", json=body)
        await wait_for(lambda: len(sim.engine.waiting) == 1, within=10, what="one queued")
        queued.close()
        await wait_for(lambda: sim.engine.stats.aborted["queued"] == 1, within=10, what="abort")
        assert not sim.engine.waiting
        assert len(sim.engine.running) == 1  # the other request is untouched
        running.close()
        await wait_for(lambda: sim.engine.stats.aborted["decode"] == 1, within=10, what="abort 2")
        assert_clean(sim)


async def test_disconnect_during_prefill(client: aiohttp.ClientSession) -> None:
    # 4,000 prompt tokens in chunks of 16: about 250 steps of prefill.
    config = FAST.replace(max_num_batched_tokens=16, max_model_len=8192)
    async with running_sim(config) as sim:
        body = completion_body("w " * 4000, stream=True, **LONG)
        resp = await client.post(f"{sim.url}/v1/completions", json=body)
        await wait_for(lambda: sim.engine.pool.usage > 0, within=10, what="prefill under way")
        assert sim.engine.running[0].phase() == "prefill"
        resp.close()
        await wait_for(lambda: sim.engine.stats.aborted["prefill"] == 1, within=10, what="abort")
        assert_clean(sim)
        assert sim.engine.stats.generation_tokens == 0


async def test_disconnect_during_decode_stops_generation(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = chat_body(stream=True, **LONG)
    async with client.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
        chunks = 0
        async for line in resp.content:
            chunks += line.startswith(b"data: ")
            if chunks == 6:  # the role chunk and five tokens
                break
        resp.close()
    await wait_for(lambda: sim.engine.stats.aborted["decode"] == 1, within=10, what="abort")
    assert_clean(sim)
    generated = sim.engine.stats.generation_tokens
    assert 5 <= generated < 4000
    assert sim.driver.steps < 4000


async def test_disconnect_of_a_non_streaming_request(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    task = asyncio.create_task(
        client.post(f"{sim.url}/v1/completions", json=completion_body(**LONG))
    )
    await wait_for(lambda: sim.engine.stats.generation_tokens > 3, within=10, what="decoding")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await wait_for(lambda: sum(sim.engine.stats.aborted.values()) == 1, within=10, what="abort")
    assert sim.engine.stats.aborted["decode"] == 1
    assert_clean(sim)


async def test_slot_freed_by_an_abort_admits_the_next_request(
    client: aiohttp.ClientSession,
) -> None:
    async with running_sim(FAST.replace(max_num_seqs=1)) as sim:
        hog = await client.post(
            f"{sim.url}/v1/completions", json=completion_body(stream=True, **LONG)
        )
        waiter = asyncio.create_task(
            client.post(f"{sim.url}/v1/completions", json=completion_body(max_tokens=3))
        )
        await wait_for(lambda: len(sim.engine.waiting) == 1, within=10, what="queued")
        hog.close()
        async with await waiter as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("fault", ["break_after_tokens", "error_after_tokens"])
async def test_a_stream_cut_by_a_fault_frees_its_slot_for_the_next_request(
    client: aiohttp.ClientSession, fault: str
) -> None:
    async with running_sim(FAST.replace(max_num_seqs=1)) as sim:
        url = f"{sim.url}/v1/completions"
        async with client.post(url, json=completion_body(stream=True, **LONG)) as hog:
            await hog.content.readuntil(b"\n\n")  # decoding
            waiter = asyncio.create_task(client.post(url, json=completion_body(max_tokens=3)))
            await wait_for(lambda: len(sim.engine.waiting) == 1, within=10, what="queued")
            sim.faults = Faults(**{fault: 3})  # the hog is past 3 tokens: cut at its next
            with contextlib.suppress(aiohttp.ClientError):
                await hog.read()
        async with await waiter as resp:  # a non-stream request: the fault leaves it alone
            assert (await resp.json())["usage"]["completion_tokens"] == 3
        assert sim.engine.stats.aborted["decode"] == 1
        assert sum(sim.engine.stats.request_success.values()) == 1
        await wait_for(lambda: sim.state.in_flight == 0, within=10, what="handlers done")
        assert not sim.engine.running
        assert sim.engine.pool.usage == 0.0


async def test_kill_resets_every_open_stream_and_stops_listening(
    client: aiohttp.ClientSession,
) -> None:
    sim = RunningSim(FAST)
    await sim.start()
    try:
        url = f"{sim.url}/v1/completions"
        streams = [await client.post(url, json=completion_body(stream=True, **LONG)) for _ in "ab"]
        for r in streams:
            await r.content.readuntil(b"\n\n")  # both decoding
        await sim.kill()
        for r in streams:
            with pytest.raises(aiohttp.ClientError):
                await r.read()
        await wait_for(lambda: sim.state.in_flight == 0, within=10, what="handlers done")
        assert sim.engine.stats.aborted["decode"] == 2
        assert_clean(sim)
        async with aiohttp.ClientSession() as fresh:
            with pytest.raises(aiohttp.ClientConnectorError):
                await fresh.get(f"{sim.url}/health")
    finally:
        await sim.stop()
