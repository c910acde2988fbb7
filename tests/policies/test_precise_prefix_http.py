"""precise_prefix through running gateways in front of simulators that publish KV events.

The simulators are vLLM-compatible down to the event stream (same wire form, a paged cache
with prefix caching and LRU eviction), and their own prefix-cache counters say what each
request really reused: the gateway's prediction is checked against them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp

from policies import PrecisePrefix
from policies.kv_index import chain_keys
from tests.helpers import RunningGateway, running_gateway, sample, wait_for
from tools.sim import FAST, running_sim
from tools.sim.kvevents import KvEventsConfig
from tools.sim.testing import RunningSim

EVENTS = KvEventsConfig(
    enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"
)
MODEL = "sim-model"


def chat(system: str, user: str, max_tokens: int = 2) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def served(sims: list[RunningSim]) -> list[int]:
    return [sum(s.engine.stats.request_success.values()) for s in sims]


def gateway_settings(**overrides: Any) -> dict[str, Any]:
    return {"policy": "precise_prefix", "tokenizers": {MODEL: "sim"}, **overrides}


@asynccontextmanager
async def fleet(
    n: int = 3, blocks: int = 2048, events: list[bool] | None = None, **overrides: Any
) -> AsyncIterator[tuple[list[RunningSim], RunningGateway]]:
    on = events or [True] * n
    async with AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(
                running_sim(
                    FAST.replace(
                        kv_events=EVENTS if on[i] else None,
                        num_gpu_blocks_override=blocks,
                        max_model_len=min(4096, blocks * 16),
                    )
                )
            )
            for i in range(n)
        ]
        gw = await stack.enter_async_context(
            running_gateway([s.url for s in sims], **gateway_settings(**overrides))
        )
        await wait_for(gw.ready, what="gateway ready")
        index = gw.svc.kv_index
        await wait_for(
            lambda: all(
                index.exact(b.id) for b, ok in zip(gw.svc.pool.all(), on, strict=True) if ok
            ),
            within=10.0,
            what="every publisher followed",
        )
        yield sims, gw


async def send(
    session: aiohttp.ClientSession, gw: RunningGateway, sims: list[RunningSim], body: Any
) -> int:
    """One request through the gateway; the index of the simulator that served it."""
    before = served(sims)
    async with session.post(gw.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
    await wait_for(lambda: sum(served(sims)) == sum(before) + 1, what="request counted")
    after = served(sims)
    return next(i for i in range(len(sims)) if after[i] > before[i])


def policy_of(gw: RunningGateway) -> PrecisePrefix:
    policy = gw.svc.router.policy
    assert isinstance(policy, PrecisePrefix)
    return policy


def tokens_of(gw: RunningGateway, body: dict[str, Any]) -> list[int]:
    tok = gw.svc.tokenizers.get(MODEL)
    assert tok is not None
    tokens = tok.prompt_tokens("chat", body)
    assert tokens is not None
    return tokens


def backend_ids(gw: RunningGateway) -> list[str]:
    return [b.id for b in gw.svc.pool.all()]


async def settled(gw: RunningGateway, sims: list[RunningSim], body: dict[str, Any]) -> None:
    """Wait until the index holds what the engines hold of ``body``'s prompt (events are
    published after each engine step, and applied a moment later)."""
    tokens = tokens_of(gw, body)
    index = gw.svc.kv_index
    ids = backend_ids(gw)

    def agree() -> bool:
        keys = chain_keys(tokens, 16)
        held = index.match(keys, ids)
        return all(held[ids[i]] == engine_blocks(s, tokens) for i, s in enumerate(sims))

    await wait_for(agree, within=5.0, what="the index to agree with the engines")


def engine_blocks(sim: RunningSim, tokens: list[int]) -> int:
    """How many leading full blocks of ``tokens`` the simulator's cache holds right now."""
    return sim.engine.pool.cached_run(tokens)


async def test_a_prefix_goes_where_the_engine_holds_it_and_the_prediction_is_the_hit() -> None:
    async with fleet() as (sims, gw), aiohttp.ClientSession() as s:
        system = words("sys", 200)
        first = await send(s, gw, sims, chat(system, "hello"))
        probe = chat(system, "and again")
        await settled(gw, sims, probe)
        policy = policy_of(gw)
        tokens = tokens_of(gw, probe)
        predicted = {b: policy.predicted(tokens, b) for b in backend_ids(gw)}
        assert predicted[backend_ids(gw)[first]] >= 192  # the system prompt's 12+ blocks
        hits_before = [sim.engine.stats.prefix_cache_hits for sim in sims]
        landed = await send(s, gw, sims, probe)
        assert landed == first
        hits = sims[landed].engine.stats.prefix_cache_hits - hits_before[landed]
        assert hits == predicted[backend_ids(gw)[landed]]
        assert policy.decisions["prefix"] >= 1


async def test_traffic_from_elsewhere_that_evicts_a_prefix_is_seen() -> None:
    """The engine evicts the prefix because of requests this gateway never sent (another
    replica, a client going direct): prefix_affinity would still believe it is there."""
    async with fleet(blocks=64) as (sims, gw), aiohttp.ClientSession() as s:
        system = words("keep", 300)  # about 19 blocks of 16
        body = chat(system, "q")
        first = await send(s, gw, sims, body)
        await settled(gw, sims, body)
        bid = backend_ids(gw)[first]
        tokens = tokens_of(gw, body)
        assert policy_of(gw).predicted(tokens, bid) >= 288
        for k in range(6):  # straight to that engine: 6 x ~50 blocks through a 64-block cache
            async with s.post(
                sims[first].url + "/v1/chat/completions", json=chat(words(f"evict{k}", 800), "x")
            ) as r:
                assert r.status == 200, await r.text()
        await settled(gw, sims, body)
        after = policy_of(gw).predicted(tokens, bid)
        assert after == engine_blocks(sims[first], tokens) * 16
        assert after < 288
        hits_before = sims[first].engine.stats.prefix_cache_hits
        async with s.post(sims[first].url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
        # What the engine reused is what the gateway said it held (capped at len - 1).
        reused = sims[first].engine.stats.prefix_cache_hits - hits_before
        assert reused == after


async def test_two_gateways_hold_the_same_index_without_talking() -> None:
    async with fleet() as (sims, gw), AsyncExitStack() as stack:
        other = await stack.enter_async_context(
            running_gateway([x.url for x in sims], **gateway_settings())
        )
        index2 = other.svc.kv_index
        await wait_for(
            lambda: all(index2.exact(b) for b in backend_ids(other)), within=10.0, what="live"
        )
        async with aiohttp.ClientSession() as s:
            bodies = [chat(words(f"g{g}", 150), f"u{g}") for g in range(4)]
            for body in bodies:
                await send(s, gw, sims, body)  # all through the first gateway
            for body in bodies:
                await settled(gw, sims, body)
                await settled(other, sims, body)
            one, two = gw.svc.kv_index.stats(), index2.stats()
            assert {b: st.blocks for b, st in one.items()} == {
                b: st.blocks for b, st in two.items()
            }
            # The second gateway, which routed nothing, sends each prompt where it is cached.
            landed = [await send(s, other, sims, body) for body in bodies]
            expected = [
                max(range(3), key=lambda i: engine_blocks(sims[i], tokens_of(gw, b)))
                for b in bodies
            ]
            assert landed == expected


async def test_a_backend_without_events_falls_back_and_says_so() -> None:
    async with fleet(events=[True, True, False]) as (sims, gw), aiohttp.ClientSession() as s:
        feeds = gw.svc.kv_feeds
        assert feeds is not None
        off = backend_ids(gw)[2]
        await wait_for(lambda: feeds.status[off].state == "off", what="the feed off")
        assert "--kv-events-config" in feeds.status[off].why
        await send(s, gw, sims, chat(words("fb", 100), "x"))
        assert policy_of(gw).decisions["fallback_not_live"] == 1
        assert sample(gw, "llm_gateway_kv_events_state", backend=off, state="off") == 1.0
        assert (
            sample(gw, "llm_gateway_precise_prefix_decisions_total", reason="fallback_not_live")
            == 1.0
        )


async def test_a_restarted_engine_is_forgotten_until_it_reports_again() -> None:
    async with fleet() as (sims, gw), aiohttp.ClientSession() as s:
        body = chat(words("rs", 200), "x")
        first = await send(s, gw, sims, body)
        await settled(gw, sims, body)
        bid = backend_ids(gw)[first]
        tokens = tokens_of(gw, body)
        assert policy_of(gw).predicted(tokens, bid) > 0
        await sims[first].kill()
        await sims[first].start()  # same ports, a new process as far as the events go
        await wait_for(
            lambda: policy_of(gw).predicted(tokens, bid) == 0,
            within=10.0,
            what="the restarted engine's old blocks forgotten",
        )
