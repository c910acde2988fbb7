"""The production configuration, every feature on at once: what breaks only in combination."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import aiohttp
import redis
from prometheus_client.parser import text_string_to_metric_families

from gateway.observe.metrics import QUEUE_DEPTH_METRIC
from policies import PrecisePrefix
from tests.gateway.production import ADMIN, ALIAS, auth, running_production
from tests.helpers import events, sample, wait_for
from tools.sim import FAST
from tools.sim.kvevents import KvEventsConfig

CHAT = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for point in family.samples:
            out.setdefault(point.name, []).append((point.labels, point.value))
    return out


async def test_metrics_answer_with_the_admission_queue_and_every_other_feature_on(
    redis_url: str, redis_prefix: str
) -> None:
    """/metrics (and /admin/metrics) must not fail exactly when the queue matters (issue 16.1)."""
    async with (
        running_production(redis_url, redis_prefix) as prod,
        aiohttp.ClientSession() as s,
    ):
        for name in ("alice", "bob"):
            async with s.post(
                prod.url + "/v1/chat/completions", json=CHAT, headers=auth(name)
            ) as r:
                assert r.status == 200, await r.text()
        async with s.get(prod.url + "/metrics") as r:
            assert r.status == 200
            public = families(await r.text())
        async with s.get(prod.admin_url + "/admin/metrics", headers=ADMIN) as r:
            assert r.status == 200
            admin = families(await r.text())
    for got in (public, admin):
        assert QUEUE_DEPTH_METRIC in got
        outcomes = {
            labels["outcome"]: v for labels, v in got["llm_gateway_admission_outcomes_total"]
        }
        assert outcomes["admitted_at_once"] == 2
        assert "llm_gateway_prefix_affinity_decisions_total" in got
        assert any(
            labels["pool"] in ("stable", "canary")
            for labels, _ in got["llm_gateway_pool_requests_total"]
        )


async def test_streams_cut_by_a_dying_backend_go_on_with_every_feature_on(
    redis_url: str, redis_prefix: str
) -> None:
    """Keys, Redis limits, admission, prefix affinity, an alias over pools and tracing, and a
    backend of the stable pool that resets its streams after five tokens: every stream is
    continued inside its pool, under the alias's name, its usage whole, and nothing is held
    afterwards (issue 18 in the production configuration)."""
    n, max_tokens = 12, 40
    async with (
        running_production(redis_url, redis_prefix) as prod,
        aiohttp.ClientSession() as s,
    ):
        prod.sims[0].faults = replace(prod.sims[0].faults, break_after_tokens=5)

        async def one(i: int) -> list[Any]:
            body = {
                "model": ALIAS,
                "messages": [{"role": "user", "content": f"story number {i} " * 8}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            headers = {**auth("alice"), "x-session-id": f"s{i}"}
            async with s.post(prod.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                return events(await r.read())

        streams = await asyncio.gather(*(one(i) for i in range(n)))
        gw = prod.gateway
        continued = sample(
            gw, "llm_gateway_stream_continuations_total", reason="unreachable", outcome="continued"
        )
        admission = gw.svc.admission
        assert admission is not None
        await wait_for(lambda: admission.holding == 0, what="admission slots given back")
    for evs in streams:
        assert evs[-1] == "[DONE]"
        assert not any(isinstance(e, dict) and "error" in e for e in evs)
        chunks = [e for e in evs if isinstance(e, dict)]
        assert {e["model"] for e in chunks} == {ALIAS}  # the alias's name, continued or not
        assert len({e["id"] for e in chunks}) == 1
        [usage] = [e["usage"] for e in chunks if e.get("usage")]
        assert usage["completion_tokens"] == max_tokens
    assert continued >= 1  # the stable pool's broken backend took some of them
    assert set(gw.in_flight().values()) == {0}
    server = [sp for sp in prod.spans.get_finished_spans() if sp.name.startswith("POST")]
    assert sum(1 for sp in server if (sp.attributes or {}).get("llm_gateway.continuations")) == (
        continued
    )
    client = redis.Redis.from_url(redis_url)
    try:
        slots = sum(client.zcard(k) for k in client.scan_iter(match=f"{redis_prefix}*:c"))
    finally:
        client.close()
    assert slots == 0  # no concurrency slot left in Redis


async def test_precise_prefix_with_every_feature_on(redis_url: str, redis_prefix: str) -> None:
    """The production configuration with precise_prefix: the simulators publish KV events,
    requests arrive under the alias (its pools narrow the candidates), with keys, Redis limits,
    admission and sessions. Long shared contexts go where the engine caches them, inside their
    pool, nothing falls back, and a killed backend's entries are dropped (issue 19)."""
    events_on = KvEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"
    )
    async with (
        running_production(
            redis_url,
            redis_prefix,
            sim_config=FAST.replace(kv_events=events_on),
            policy="precise_prefix",
            tokenizers={"sim-model": "sim"},
            rollout={"sticky_header": "x-context"},
        ) as prod,
        aiohttp.ClientSession() as s,
    ):
        gw = prod.gateway
        index = gw.svc.kv_index
        await wait_for(
            lambda: all(index.exact(b.id) for b in gw.svc.pool.all()),
            within=10.0,
            what="every publisher followed",
        )
        contexts = [" ".join(f"ctx{g}w{i}" for i in range(200)) for g in range(3)]

        def indexed_blocks() -> int:
            return sum(index.blocks(b.id) for b in gw.svc.pool.all())

        for turn in range(3):
            for g, ctx in enumerate(contexts):
                body = {
                    "model": ALIAS,
                    "max_tokens": 2,
                    "messages": [
                        {"role": "system", "content": ctx},
                        {"role": "user", "content": f"turn {turn}"},
                    ],
                }
                indexed = indexed_blocks()
                # The alias's split keyed by context sends its repeats to its pool (at random,
                # 1 in 5 repeats would cross to the other pool, whose engines lack it); not a
                # session, which would route the repeats before the prefix is looked at.
                headers = {**auth("alice"), "x-context": f"ctx{g}"}
                async with s.post(
                    prod.url + "/v1/chat/completions", json=body, headers=headers
                ) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                await wait_for(lambda: set(gw.in_flight().values()) == {0}, what="idle")
                if turn == 0:  # its context's blocks reach the index (KV events) before a repeat
                    await wait_for(
                        lambda i=indexed: indexed_blocks() > i,
                        what="the context's blocks indexed",
                    )
        policy = gw.svc.router.policy
        assert isinstance(policy, PrecisePrefix)
        assert policy.decisions["prefix"] >= 4  # repeats found their context (most of 6)
        assert policy.decisions["fallback_not_live"] == 0
        assert policy.decisions["fallback_no_tokens"] == 0
        hits = sum(sim.engine.stats.prefix_cache_hits for sim in prod.sims)
        assert hits >= 4 * 12 * 16  # each found repeat reused the context's 12 full blocks
        async with s.get(prod.admin_url + "/admin/kv-events", headers=ADMIN) as r:
            assert r.status == 200
            view = await r.json()
        assert all(b["state"] == "live" for b in view["backends"].values())
        assert sum(b["blocks"] for b in view["backends"].values()) > 0
        victim = next(b for b in gw.svc.pool.all() if index.blocks(b.id))
        sim = next(x for x in prod.sims if x.url == victim.spec.url)
        await sim.kill()
        await wait_for(lambda: index.blocks(victim.id) == 0, within=10.0, what="entries dropped")
        assert not index.exact(victim.id)
