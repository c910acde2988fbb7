"""vLLM's token-in, token-out route (``/inference/v1/generate``) through the gateway, on
simulators: the same token ids as the server gives directly, stream or not; only to the
servers started with ``--enable-scale-out`` (the others' 403 passes them over); aborted by the
id the client chose, on the backend running it, by its owner only; stopped when the client
leaves; and a broken token stream continued from its prompt and the ids already sent."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from gateway.limits.keys import hash_key
from gateway.tokenizer.words import tokenize
from tests.helpers import RunningGateway, running_gateway, sample, wait_for
from tools.sim import FAST, Faults, RunningSim, running_sim

SCALE_OUT = FAST.replace(enable_scale_out=True, output_len_min=200)
MODEL = FAST.model_name
PROMPT = tokenize("the gateway routes token ids as they are")


def body(max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "seed": 3},
        **extra,
    }


def stream_ids(raw: bytes) -> tuple[list[int], list[str], dict[str, Any] | None]:
    """Every token id a generate stream carried, its finish reasons, and its usage."""
    ids: list[int] = []
    finishes: list[str] = []
    usage = None
    for chunk in raw.split(b"\n\n"):
        data = chunk.removeprefix(b"data: ").strip()
        if not data or data == b"[DONE]":
            continue
        doc = json.loads(data)
        assert "error" not in doc, doc
        for c in doc["choices"]:
            ids += c.get("token_ids") or []
            if c.get("finish_reason"):
                finishes.append(c["finish_reason"])
        usage = doc.get("usage") or usage
    return ids, finishes, usage


@asynccontextmanager
async def fleet(
    configs: tuple[Any, ...] = (SCALE_OUT, SCALE_OUT),
    faults: Faults | None = None,
    **overrides: Any,
) -> AsyncIterator[tuple[RunningGateway, list[RunningSim]]]:
    async with running_sim(configs[0], faults) as a, running_sim(configs[1]) as b:
        backends = [{"url": a.url, "name": "sim0"}, {"url": b.url, "name": "sim1"}]
        async with running_gateway(backends, **overrides) as gw:
            yield gw, [a, b]


async def test_the_same_ids_as_the_server_gives_stream_or_not() -> None:
    async with fleet() as (gw, sims), aiohttp.ClientSession() as s:
        async with s.post(sims[0].url + "/inference/v1/generate", json=body()) as r:
            direct = await r.json()
        async with s.post(gw.url + "/inference/v1/generate", json=body()) as r:
            assert r.status == 200
            through = await r.json()
        assert through["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
        assert len(direct["choices"][0]["token_ids"]) == 12
        async with s.post(gw.url + "/inference/v1/generate", json=body(stream=True)) as r:
            ids, finishes, usage = stream_ids(await r.read())
        assert ids == direct["choices"][0]["token_ids"]
        assert finishes == ["length"]
        assert usage is None  # not asked for, so not shown (the gateway asked, and kept it)


async def test_servers_without_scale_out_are_passed_over() -> None:
    # Round robin: the server without the flag is some request's first choice, not by luck.
    async with (
        fleet((FAST, SCALE_OUT), policy="round_robin") as (gw, sims),
        aiohttp.ClientSession() as s,
    ):
        for _ in range(4):
            async with s.post(gw.url + "/inference/v1/generate", json=body(4)) as r:
                assert r.status == 200, await r.text()
        assert sims[1].engine.stats.generation_tokens == 16
        assert sims[0].engine.stats.generation_tokens == 0
        lacking = gw.svc.pool.get("sim0")
        assert lacking is not None
        assert "generate" in lacking.lacks  # learned from its 403, if it was ever tried
        assert (
            sample(
                gw,
                "llm_gateway_requests_total",
                model=MODEL,
                backend="sim1",
                status="200",
                endpoint="generate",
            )
            == 4
        )


async def test_an_abort_by_the_clients_id_reaches_the_engine_running_it() -> None:
    paced = SCALE_OUT.replace(step_base_ms=20.0)
    async with fleet((paced, paced)) as (gw, _sims), aiohttp.ClientSession() as s:
        doc = body(500, stream=True, request_id="rl-rollout-7")
        async with s.post(gw.url + "/inference/v1/generate", json=doc) as r:
            await r.content.readuntil(b"\n\n")  # under way
            abort = {"request_ids": ["generate-tokens-rl-rollout-7"]}
            async with s.post(gw.url + "/inference/v1/abort_requests", json=abort) as a:
                assert a.status == 200
                answer = await a.json()
            assert answer["unknown"] == []
            assert sum(len(v) for v in answer["sent"].values()) == 1
            ids, finishes, _ = stream_ids(await r.read())
        assert finishes == ["abort"]
        assert len(ids) < 500
        await wait_for(lambda: len(gw.svc.generations) == 0, what="the generation forgotten")


async def test_no_key_aborts_another_keys_generation() -> None:
    keys = {
        "auth": True,
        "tiers": {"default": {}},
        "keys": [{"name": "a", "hash": hash_key("sk-a")}, {"name": "b", "hash": hash_key("sk-b")}],
    }
    paced = SCALE_OUT.replace(step_base_ms=20.0)
    async with fleet((paced, paced), limits=keys) as (gw, _sims), aiohttp.ClientSession() as s:
        doc = body(40, stream=True, request_id="mine")
        a_key = {"Authorization": "Bearer sk-a"}
        async with s.post(gw.url + "/inference/v1/generate", json=doc, headers=a_key) as r:
            first = await r.content.readuntil(b"\n\n")
            abort = {"request_ids": ["mine"]}
            b_key = {"Authorization": "Bearer sk-b"}
            async with s.post(
                gw.url + "/inference/v1/abort_requests", json=abort, headers=b_key
            ) as a:
                assert (await a.json()) == {"sent": {}, "failed": {}, "unknown": ["mine"]}
            ids, finishes, _ = stream_ids(first + await r.read())
        assert finishes == ["length"]
        assert len(ids) == 40
        async with s.post(
            gw.url + "/inference/v1/abort_requests", json={"request_ids": "x"}, headers=a_key
        ) as a:
            assert a.status == 400
            assert (await a.json())["error"]["param"] == "request_ids"


async def test_a_client_that_leaves_stops_the_generation() -> None:
    paced = SCALE_OUT.replace(step_base_ms=20.0)
    async with running_sim(paced) as sim, running_gateway([sim.url]) as gw:
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw.url + "/inference/v1/generate", json=body(500, stream=True)) as r,
        ):
            await r.content.readuntil(b"\n\n")
        await wait_for(lambda: sum(sim.engine.stats.aborted.values()) == 1, what="an abort")
        await wait_for(lambda: set(gw.in_flight().values()) == {0}, what="no lease left")


async def test_a_broken_token_stream_goes_on_from_its_ids() -> None:
    doc = body(60, stream=True, stream_options={"include_usage": True})
    async with (
        # Round robin: the breaking backend is some request's first choice (least_load breaks
        # the tie of idle backends at random: 4 requests could all miss it, 1 in 16).
        fleet(faults=Faults(break_after_tokens=20), policy="round_robin") as (gw, _sims),
        aiohttp.ClientSession() as s,
    ):
        for _ in range(4):
            async with s.post(gw.url + "/inference/v1/generate", json=doc) as r:
                assert r.status == 200
                ids, finishes, usage = stream_ids(await r.read())
            assert len(ids) == 60
            assert finishes == ["length"]
            assert usage is not None
            assert usage["completion_tokens"] == 60
            assert usage["prompt_tokens"] == len(PROMPT)
        assert (
            sample(
                gw,
                "llm_gateway_stream_continuations_total",
                reason="unreachable",
                outcome="continued",
            )
            >= 1
        )
