"""/metrics: vLLM V1 names, types and labels, readable by prometheus_client's parser."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.waiting import wait_for
from tools.sim import FAST, RunningSim, running_sim

from .conftest import completion_body

LABELS = {"model_name": FAST.model_name, "engine": "0"}

EXPECTED_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "sim:aborted_requests": "counter",
    "sim:clock_lag_seconds": "gauge",
}


async def scrape(client: aiohttp.ClientSession, sim: RunningSim) -> dict[str, list[Sample]]:
    async with client.get(f"{sim.url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in EXPECTED_TYPES.items():
        assert families[name].type == kind, name
    return {name: f.samples for name, f in families.items()}


def value(samples: list[Sample], name: str, **labels: str) -> float:
    want = {**LABELS, **labels}
    matches = [s.value for s in samples if s.name == name and s.labels == want]
    assert len(matches) == 1, (name, want, samples)
    return matches[0]


async def test_metrics_names_types_labels_and_values(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    for prompt in ("a b c", "a b c d e"):
        body = completion_body(prompt, max_tokens=4)
        async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
    m = await scrape(client, sim)
    assert value(m["vllm:prompt_tokens"], "vllm:prompt_tokens_total") == 8
    assert value(m["vllm:generation_tokens"], "vllm:generation_tokens_total") == 8
    success = m["vllm:request_success"]
    assert value(success, "vllm:request_success_total", finished_reason="length") == 2
    for reason in ("stop", "abort"):
        assert value(success, "vllm:request_success_total", finished_reason=reason) == 0
    assert value(m["vllm:num_requests_running"], "vllm:num_requests_running") == 0
    assert value(m["vllm:kv_cache_usage_perc"], "vllm:kv_cache_usage_perc") == 0
    ttft = m["vllm:time_to_first_token_seconds"]
    assert value(ttft, "vllm:time_to_first_token_seconds_count") == 2
    assert value(ttft, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == 2
    assert value(ttft, "vllm:time_to_first_token_seconds_sum") > 0
    itl = m["vllm:inter_token_latency_seconds"]
    assert value(itl, "vllm:inter_token_latency_seconds_count") == 6
    e2e = m["vllm:e2e_request_latency_seconds"]
    assert value(e2e, "vllm:e2e_request_latency_seconds_count") == 2
    queue = m["vllm:request_queue_time_seconds"]
    assert value(queue, "vllm:request_queue_time_seconds_count") == 2
    assert value(m["vllm:prefix_cache_queries"], "vllm:prefix_cache_queries_total") == 8
    (lag,) = m["sim:clock_lag_seconds"]
    assert lag.value == sim.driver.lag


async def test_gauges_follow_running_waiting_and_kv_usage(
    client: aiohttp.ClientSession,
) -> None:
    async with running_sim(FAST.replace(max_num_seqs=1, num_gpu_blocks_override=256)) as sim:
        body = completion_body("w " * 40, stream=True, max_tokens=4000, ignore_eos=True)
        first = await client.post(f"{sim.url}/v1/completions", json=body)
        second = await client.post(f"{sim.url}/v1/completions", json=body)
        await wait_for(lambda: len(sim.engine.waiting) == 1, within=10, what="one waiting")
        m = await scrape(client, sim)
        assert value(m["vllm:num_requests_running"], "vllm:num_requests_running") == 1
        assert value(m["vllm:num_requests_waiting"], "vllm:num_requests_waiting") == 1
        usage = value(m["vllm:kv_cache_usage_perc"], "vllm:kv_cache_usage_perc")
        assert 3 / 256 <= usage < 1  # 40 prompt tokens = 3 blocks at least
        second.close()
        await wait_for(lambda: not sim.engine.waiting, within=10, what="queued one aborted")
        first.close()
        await wait_for(lambda: not sim.engine.has_work(), within=10, what="running one aborted")
        m = await scrape(client, sim)
        aborted = m["sim:aborted_requests"]
        phases = {s.labels["phase"]: s.value for s in aborted if s.name.endswith("_total")}
        assert phases == {"queued": 1, "transfer": 0, "prefill": 0, "decode": 1}
        success = m["vllm:request_success"]
        assert value(success, "vllm:request_success_total", finished_reason="abort") == 0


async def test_prefix_cache_and_preemption_counters(client: aiohttp.ClientSession) -> None:
    config = FAST.replace(block_size=4, num_gpu_blocks_override=16, max_model_len=64)
    async with running_sim(config) as sim:
        body = completion_body("w " * 16, max_tokens=40, ignore_eos=True)
        async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
            assert resp.status == 200

        async def completion_tokens() -> int:
            async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
                tokens: int = (await resp.json())["usage"]["completion_tokens"]
                return tokens

        # Two requests of 56 tokens (14 blocks) each cannot both fit in 16 blocks.
        assert list(await asyncio.gather(completion_tokens(), completion_tokens())) == [40, 40]
        m = await scrape(client, sim)
    assert value(m["vllm:prefix_cache_hits"], "vllm:prefix_cache_hits_total") >= 12
    assert value(m["vllm:num_preemptions"], "vllm:num_preemptions_total") >= 1
