"""prefix_affinity through a running gateway in front of three simulators."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp

from policies import PrefixAffinity
from tests.helpers import RunningGateway, running_gateway, wait_for
from tools.sim import FAST, running_sim
from tools.sim.testing import RunningSim

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def chat(system: str, user: str) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def served(sims: list[RunningSim]) -> list[int]:
    return [sum(s.engine.stats.request_success.values()) for s in sims]


def named(sims: list[RunningSim]) -> list[dict[str, Any]]:
    """The backends under fixed names: rendezvous placement is then the same on every run
    (by URL it would depend on the ports the simulators got)."""
    return [{"url": s.url, "name": f"sim{i}"} for i, s in enumerate(sims)]


@asynccontextmanager
async def fleet(**overrides: Any) -> AsyncIterator[tuple[list[RunningSim], RunningGateway]]:
    async with AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(running_sim(FAST)) for _ in range(3)]
        gw = await stack.enter_async_context(
            running_gateway(named(sims), policy="prefix_affinity", **overrides)
        )
        await wait_for(gw.ready, what="gateway ready")
        yield sims, gw


async def send(
    session: aiohttp.ClientSession,
    gw: RunningGateway,
    sims: list[RunningSim],
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> int:
    """Send one request; return the index of the simulator that served it."""
    before = served(sims)
    async with session.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
    await wait_for(lambda: sum(served(sims)) == sum(before) + 1, what="request counted")
    after = served(sims)
    return next(i for i in range(len(sims)) if after[i] > before[i])


async def test_requests_sharing_a_long_prefix_land_on_the_same_backend() -> None:
    systems = [" ".join(f"{g}rule{i}" for i in range(300)) for g in "xyz"]  # ~2 KB each
    async with fleet() as (sims, gw), aiohttp.ClientSession() as s:
        landed: dict[int, set[int]] = {g: set() for g in range(3)}
        for turn in range(4):
            for g, system in enumerate(systems):
                # One at a time: every backend is idle when the policy decides.
                assert all(n == 0 for n in gw.in_flight().values())
                landed[g].add(await send(s, gw, sims, chat(system, f"question {turn}")))
        assert all(len(backends) == 1 for backends in landed.values()), landed
        policy = gw.svc.router.policy
        assert isinstance(policy, PrefixAffinity)
        assert policy.decisions["load"] + policy.decisions["prefix"] == 12
        # The backends' own prefix caches agree: each of the 9 repeats reused the system
        # prompt's full 16-token blocks (about 300 tokens; 16 blocks at least).
        hits = sum(sim.engine.stats.prefix_cache_hits for sim in sims)
        assert hits >= 9 * 16 * 16
        async with s.get(gw.url + "/metrics") as r:
            text = await r.text()
        entries = next(
            line
            for line in text.splitlines()
            if line.startswith("llm_gateway_prefix_index_entries")
        )
        assert float(entries.split()[-1]) > 3 * 30
        assert 'llm_gateway_prefix_affinity_decisions_total{reason="prefix"}' in text


async def test_replicas_with_hash_placement_put_a_new_prefix_on_the_same_backend() -> None:
    """Two gateways in front of the same three simulators, each seeing a prefix for the first
    time, send it to the same backend (room placement would choose by each one's own view)."""
    systems = [" ".join(f"{g}rule{i}" for i in range(100)) for g in "uvwxyz"]
    hashed = {"placement": "hash"}
    async with (
        fleet(affinity=hashed) as (sims, one),
        running_gateway(named(sims), policy="prefix_affinity", affinity=hashed) as two,
        aiohttp.ClientSession() as s,
    ):
        await wait_for(two.ready, what="second gateway ready")
        pairs = [
            (
                await send(s, one, sims, chat(system, "first")),
                await send(s, two, sims, chat(system, "second")),
            )
            for system in systems
        ]
    assert all(a == b for a, b in pairs), pairs
    assert len({a for a, _ in pairs}) > 1  # and the prefixes spread over the backends


async def test_a_session_header_keeps_a_conversation_on_one_backend() -> None:
    async with (
        fleet(affinity={"session_header": "x-session-id"}) as (sims, gw),
        aiohttp.ClientSession() as s,
    ):
        for session in ("alpha", "beta", "gamma"):
            landed = {
                await send(s, gw, sims, chat(f"unrelated {i}", "hi"), {"x-session-id": session})
                for i in range(3)
            }
            assert len(landed) == 1, (session, landed)


async def test_weights_and_thresholds_are_tuned_live_without_forgetting_prefixes() -> None:
    async with fleet(admin={"token": TOKEN}) as (sims, gw), aiohttp.ClientSession() as s:
        assert gw.admin_url is not None
        await send(s, gw, sims, chat("a long shared system prompt " * 20, "hi"))
        before = gw.svc.router.policy
        assert isinstance(before, PrefixAffinity)
        assert len(before.index) > 0
        change = {
            "weights": {"active": 1, "queue": 1, "kv": 0},
            "affinity": {"balance_abs": 2, "placement": "hash"},
        }
        async with s.put(gw.admin_url + "/admin/policy", json=change, headers=AUTH) as r:
            assert r.status == 200
            doc = await r.json()
        assert doc["policy"] == "prefix_affinity"
        assert doc["affinity"]["balance_abs"] == 2
        assert doc["affinity"]["placement"] == "hash"
        assert doc["affinity"]["balance_rel"] == 1.5
        after = gw.svc.router.policy
        assert isinstance(after, PrefixAffinity)
        assert after is not before
        assert after.index is before.index
        assert after.weights.active == 1
        for bad in (
            {"affinity": {"balance_rel": 0.5}},
            {"affinity": {"nonsense": 1}},
            {"affinity": {"placement": "random"}},
        ):
            async with s.put(gw.admin_url + "/admin/policy", json=bad, headers=AUTH) as r:
                assert r.status == 400, await r.text()
            assert gw.svc.router.policy is after
