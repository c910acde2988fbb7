"""Disaggregated prefill/decode through the gateway, against simulators in-process: the two
steps, each pool's retries, errors in OpenAI's shape, and client disconnects in each step."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from backends.pool import BackendPool
from backends.state import BackendSpec
from gateway.request.disagg import PREFILL_KV_PARAMS, prefill_body
from tests.helpers import RunningGateway, events, running_gateway, sample, wait_for
from tools.sim import FAST, Faults, RunningSim, SimConfig, running_sim

MODEL = FAST.model_name
PREFILL = FAST.replace(kv_role="kv_producer")
DECODE = FAST.replace(kv_role="kv_consumer", kv_transfer_us_per_token=1.0)
ROUND_ROBIN = {"policy": "round_robin"}  # a known order: the first listed backend first


@asynccontextmanager
async def fleet(
    prefill: Sequence[SimConfig] = (PREFILL, PREFILL),
    decode: Sequence[SimConfig] = (DECODE, DECODE),
    **overrides: Any,
) -> AsyncIterator[tuple[list[RunningSim], list[RunningSim], RunningGateway]]:
    """Prefill and decode simulators behind a gateway that has seen them all up."""
    async with AsyncExitStack() as stack:
        ps = [await stack.enter_async_context(running_sim(c)) for c in prefill]
        ds = [await stack.enter_async_context(running_sim(c)) for c in decode]
        backends = [{"url": s.url, "name": f"p{i}", "role": "prefill"} for i, s in enumerate(ps)]
        backends += [{"url": s.url, "name": f"d{i}", "role": "decode"} for i, s in enumerate(ds)]
        gw = await stack.enter_async_context(running_gateway(backends, **overrides))
        pool = gw.svc.pool
        await wait_for(
            lambda: all(pool.routable(b, pool.now()) for b in pool.all()), what="backends up"
        )
        yield ps, ds, gw


def chat(stream: bool, max_tokens: int = 8, prompt: str = "hello there") -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def no_leaks(gw: RunningGateway, sims: Sequence[RunningSim]) -> bool:
    return all(v == 0 for v in gw.in_flight().values()) and all(
        s.state.in_flight == 0 for s in sims
    )


async def test_stream_runs_prefill_then_decode() -> None:
    async with fleet() as (ps, ds, gw), aiohttp.ClientSession() as client:
        async with client.post(f"{gw.url}/v1/chat/completions", json=chat(True)) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            got = events(await resp.read())
        assert got[-1] == "[DONE]"
        contents = [e for e in got[:-1] if e["choices"] and "content" in e["choices"][0]["delta"]]
        assert len(contents) == 1 + 8  # the role chunk, then every token
        assert got[-2]["usage"]["completion_tokens"] == 8
        assert sum(p.state.prefills_handed_off for p in ps) == 1
        assert sum(d.engine.stats.kv_transfers for d in ds) == 1
        [decoder] = [d for d in ds if d.engine.stats.kv_transfers]
        assert decoder.engine.stats.generation_tokens == 8
        prompt = decoder.engine.stats.kv_transfer_tokens + 1
        assert sum(p.engine.stats.prompt_tokens for p in ps) == prompt
        await wait_for(lambda: no_leaks(gw, ps + ds), what="nothing in flight")
        prefills = [
            sample(gw, "llm_gateway_disagg_prefill_seconds_count", model=MODEL, backend=b)
            for b in ("p0", "p1")
        ]
        assert sum(prefills) == 1
        assert sample(gw, "llm_gateway_disagg_handoff_seconds_count", model=MODEL) == 1
        labels = {"model": MODEL, "backend": "d0" if decoder is ds[0] else "d1"}
        assert sample(gw, "llm_gateway_disagg_decode_first_token_seconds_count", **labels) == 1


async def test_non_stream_completion_runs_both_steps() -> None:
    body = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 5, "ignore_eos": True}
    async with fleet() as (ps, ds, gw), aiohttp.ClientSession() as client:
        async with client.post(f"{gw.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            answer = await resp.json()
        assert answer["object"] == "text_completion"
        assert answer["usage"]["completion_tokens"] == 5
        assert answer["kv_transfer_params"] is None  # the decode's answer, not the prefill's
        assert sum(p.state.prefills_handed_off for p in ps) == 1
        assert sum(d.engine.stats.kv_transfers for d in ds) == 1
        await wait_for(lambda: no_leaks(gw, ps + ds), what="nothing in flight")


def test_prefill_request_is_one_token_unstreamed_asking_for_remote_decode() -> None:
    doc = chat(True, max_tokens=100) | {"max_completion_tokens": 100, "min_tokens": 10}
    sent = json.loads(prefill_body(doc))
    assert sent["max_tokens"] == 1
    assert sent["max_completion_tokens"] == 1
    assert sent["stream"] is False
    assert "stream_options" not in sent
    assert "min_tokens" not in sent
    assert sent["kv_transfer_params"] == dict(PREFILL_KV_PARAMS)
    assert sent["messages"] == doc["messages"]


def test_prefill_only_backends_are_left_out_of_normal_routing() -> None:
    roles = {"b": "both", "p": "prefill", "d": "decode"}
    pool = BackendPool(
        [BackendSpec(i, f"http://{i}", role=r) for i, r in roles.items()],  # type: ignore[arg-type]
        stale_after=1.0,
    )
    for b in pool.all():
        pool.record_models(b.id, ["m"])
        for _ in range(2):
            pool.record_probe(b.id, ok=True)
    assert pool.roles("m") == frozenset(roles.values())
    assert {s.id for s in pool.candidates("m")} == {"b", "d"}
    assert [s.id for s in pool.candidates("m", role="prefill")] == ["p"]
    assert [s.id for s in pool.candidates("m", role="decode")] == ["d"]


async def test_failed_prefill_is_retried_on_another_prefill_backend() -> None:
    async with fleet(disagg={"prefill": ROUND_ROBIN}) as (ps, ds, gw):
        ps[0].faults = Faults(error_rate=1.0, error_status=500)
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{gw.url}/v1/chat/completions", json=chat(True)) as resp:
                assert resp.status == 200
                assert events(await resp.read())[-1] == "[DONE]"
        assert ps[0].state.injected_errors == 1
        assert ps[1].state.prefills_handed_off == 1
        labels = {"step": "prefill", "backend": "p0", "reason": "UpstreamError"}
        assert sample(gw, "llm_gateway_disagg_step_failures_total", **labels) == 1
        await wait_for(lambda: no_leaks(gw, ps + ds), what="nothing in flight")


async def test_prefill_failing_everywhere_ends_in_an_openai_error() -> None:
    async with fleet() as (ps, ds, gw), aiohttp.ClientSession() as client:
        for p in ps:
            p.faults = Faults(error_rate=1.0, error_status=500)
        async with client.post(f"{gw.url}/v1/chat/completions", json=chat(True)) as resp:
            assert resp.status == 502
            err = (await resp.json())["error"]
        assert err["type"] == "bad_gateway"
        assert "prefill step answered 500" in err["message"]
        assert {"message", "type", "param", "code"} <= set(err)
        assert sum(p.state.injected_errors for p in ps) == 2  # each prefill backend once
        assert all(d.state.in_flight == 0 and d.engine.stats.steps == 0 for d in ds)
        await wait_for(lambda: no_leaks(gw, ps + ds), what="nothing in flight")


async def test_a_prefill_pool_that_is_busy_everywhere_passes_its_answer_on() -> None:
    """Every prefill backend answers 503: the client gets that 503, with Retry-After, not a
    gateway error (issue 16.2)."""
    async with fleet() as (ps, ds, gw), aiohttp.ClientSession() as client:
        for p in ps:
            p.faults = Faults(error_rate=1.0, error_status=503)
        async with client.post(f"{gw.url}/v1/chat/completions", json=chat(True)) as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "1"
            err = (await resp.json())["error"]
        assert {"message", "type", "param", "code"} <= set(err)
        assert sum(p.state.injected_errors for p in ps) == 2  # each prefill backend once
        assert all(d.state.in_flight == 0 and d.engine.stats.steps == 0 for d in ds)
        await wait_for(lambda: no_leaks(gw, ps + ds), what="nothing in flight")


async def test_a_request_the_prefill_refuses_is_answered_with_that_refusal() -> None:
    too_long = "word " * (FAST.max_model_len + 10)
    async with fleet() as (ps, ds, gw), aiohttp.ClientSession() as client:
        body = chat(False, prompt=too_long)
        async with client.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
        assert "maximum context length" in err["message"]
        assert all(d.engine.stats.steps == 0 for d in ds)
        assert sum(p.state.injected_errors for p in ps) == 0


async def test_failed_decode_before_first_byte_is_retried_on_another_decode_backend() -> None:
    async with fleet(disagg={"decode": ROUND_ROBIN}) as (ps, ds, gw):
        ds[0].faults = Faults(error_rate=1.0, error_status=503)
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{gw.url}/v1/chat/completions", json=chat(True)) as resp:
                assert resp.status == 200
                got = events(await resp.read())
        assert got[-2]["usage"]["completion_tokens"] == 8
        assert ds[0].state.injected_errors == 1
        assert ds[1].engine.stats.kv_transfers == 1
        assert sum(p.state.prefills_handed_off for p in ps) == 1  # the prefill is not redone
        await wait_for(lambda: no_leaks(gw, ps + ds), what="nothing in flight")


async def test_a_decode_that_dies_mid_stream_is_continued_on_another_decode_backend() -> None:
    """Its KV came from the prefill; the continuation is prefilled where it runs (the decode
    backend falls back to a local prefill without kv_transfer_params), and the client sees
    one stream with every token."""
    async with fleet(disagg={"decode": ROUND_ROBIN}) as (ps, ds, gw):
        ds[0].faults = Faults(break_after_tokens=3)
        body = {**chat(True, max_tokens=12), "stream_options": {"include_usage": True}}
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                got = events(await resp.read())
        assert not any(isinstance(e, dict) and "error" in e for e in got)
        assert got[-1] == "[DONE]"
        assert got[-2]["usage"]["completion_tokens"] == 12
        assert sum(p.state.prefills_handed_off for p in ps) == 1  # the continuation is not
        name = "llm_gateway_stream_continuations_total"
        assert sample(gw, name, reason="unreachable", outcome="continued") == 1
        await wait_for(lambda: no_leaks(gw, ps + ds), what="nothing in flight")


async def closed(sim: RunningSim) -> None:
    """``sim`` holds no request (the gateway closed it)."""
    await wait_for(lambda: sim.state.in_flight == 0, what="upstream closed")


async def cancel_when(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], reached: Any
) -> None:
    """Send ``body``, cancel the client once ``reached()`` holds."""
    task = asyncio.create_task(client.post(url, json=body))
    await wait_for(reached, within=5.0, what="the step to be running")
    task.cancel()  # aiohttp closes the client's connection
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_disconnect_during_prefill_closes_the_prefill_upstream() -> None:
    # ~19 chunks of 16 prompt tokens at 320 ms each: seconds for the client's leaving to be
    # passed on, on however busy a machine, before the prefill could end on its own
    slow = PREFILL.replace(prefill_us_per_token=20_000.0, max_num_batched_tokens=16)
    async with fleet([slow], [DECODE]) as (ps, ds, gw), aiohttp.ClientSession() as client:
        body = chat(True, prompt="word " * 300)
        await cancel_when(
            client,
            f"{gw.url}/v1/chat/completions",
            body,
            lambda: ps[0].engine.pool.usage > 0 and ps[0].engine.phase_of(1) == "prefill",
        )
        await closed(ps[0])
        assert ps[0].engine.stats.aborted["prefill"] == 1
        assert ds[0].engine.stats.steps == 0  # the decode step never began
        await wait_for(lambda: no_leaks(gw, ps + ds), what="nothing in flight")


async def test_disconnect_during_the_kv_transfer_closes_the_decode_upstream() -> None:
    slow = DECODE.replace(kv_transfer_us_per_token=20_000.0)  # seconds for the prompt's KV
    async with fleet([PREFILL], [slow]) as (ps, ds, gw), aiohttp.ClientSession() as client:
        await cancel_when(
            client,
            f"{gw.url}/v1/chat/completions",
            chat(True, prompt="word " * 300),
            lambda: ds[0].engine.phase_of(1) == "transfer",
        )
        await closed(ds[0])
        assert ds[0].engine.stats.aborted["transfer"] == 1
        await wait_for(lambda: no_leaks(gw, ps + ds), what="nothing in flight")


async def test_disconnect_mid_stream_closes_the_decode_upstream() -> None:
    slow = DECODE.replace(step_base_ms=20.0)
    async with fleet([PREFILL], [slow]) as (ps, ds, gw), aiohttp.ClientSession() as client:
        resp = await client.post(f"{gw.url}/v1/chat/completions", json=chat(True, 500))
        got = b""
        while got.count(b"data: ") < 4:
            got += await asyncio.wait_for(resp.content.readany(), 5)
        resp.close()
        await closed(ds[0])
        assert ds[0].engine.stats.aborted["decode"] == 1
        assert ds[0].engine.stats.generation_tokens < 500
        await wait_for(lambda: no_leaks(gw, ps + ds), what="nothing in flight")


async def test_each_step_gets_a_span() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with (
        fleet([PREFILL], [DECODE], tracer_provider=provider) as (_ps, _ds, gw),
        aiohttp.ClientSession() as client,
    ):
        async with client.post(f"{gw.url}/v1/chat/completions", json=chat(True)) as resp:
            await resp.read()
        await wait_for(lambda: len(exporter.get_finished_spans()) >= 3, what="spans")
    spans = exporter.get_finished_spans()
    server = next(s for s in spans if s.name.startswith("POST"))
    attempts = [s for s in spans if s.name == "upstream attempt"]
    assert server.attributes is not None
    assert server.attributes["llm_gateway.prefill_backend"] == "p0"
    assert server.attributes["llm_gateway.backend"] == "d0"
    steps = {(s.attributes or {}).get("llm_gateway.step") for s in attempts}
    assert steps == {"prefill", "decode"}  # one attempt loop, two steps
    assert all(s.parent is not None and s.parent.span_id == server.context.span_id
               for s in attempts)  # fmt: skip


async def test_no_decode_backend_up_is_a_503_before_any_prefill() -> None:
    async with fleet([PREFILL], [DECODE]) as (ps, ds, gw), aiohttp.ClientSession() as client:
        ds[0].faults = Faults(unhealthy=True)
        pool = gw.svc.pool
        decode = pool.get("d0")
        assert decode is not None
        await wait_for(lambda: not pool.routable(decode, pool.now()), what="decode down")
        async with client.post(f"{gw.url}/v1/chat/completions", json=chat(True)) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["type"] == "service_unavailable"
        assert ps[0].state.prefills_handed_off == 0
        assert ps[0].engine.stats.steps == 0
