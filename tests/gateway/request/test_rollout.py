"""Model pools and aliases through the gateway, against simulators serving two versions: the
weighted split, stickiness while weights move, rollback with a stream in flight, the model
name rewritten upstream and restored downstream, live changes refused when bad."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import ValidationError

from gateway.config.settings import Settings, load_settings
from gateway.request.rollout import Rollout
from tests.helpers import (
    FakeBackend,
    RunningGateway,
    gateway_for,
    running_gateway,
    stream_chat,
    wait_for,
)
from tests.redis_server import RedisServer
from tools.sim import FAST, RunningSim, running_sim

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ALIAS = "llama"


def pools(v1: str = "v1a", v2: str = "v2a") -> list[dict[str, Any]]:
    return [
        {"name": "v1", "model": "m-v1", "backends": [v1], "labels": {"version": "1"}},
        {"name": "v2", "model": "m-v2", "backends": [v2], "labels": {"version": "2"}},
    ]


async def all_up(gw: RunningGateway) -> None:
    pool = gw.svc.pool
    await wait_for(
        lambda: all(pool.routable(b, pool.now()) for b in pool.all()), what="backends up"
    )


@asynccontextmanager
async def fleet(weights: dict[str, float], **overrides: Any) -> AsyncIterator[RunningGateway]:
    """Two simulators, one per version, in pools v1 and v2 behind the alias ``llama``."""
    async with AsyncExitStack() as stack:
        s1 = await stack.enter_async_context(running_sim(FAST.replace(model="m-v1")))
        s2 = await stack.enter_async_context(running_sim(FAST.replace(model="m-v2")))
        backends = [{"url": s1.url, "name": "v1a"}, {"url": s2.url, "name": "v2a"}]
        gw = await stack.enter_async_context(
            running_gateway(
                backends,
                pools=pools(v2=s2.url),  # a pool may name a backend by its URL too
                aliases={ALIAS: weights},
                admin={"token": TOKEN, "port": 0},
                **overrides,
            )
        )
        await all_up(gw)
        yield gw


def chat(stream: bool, model: str = ALIAS, max_tokens: int = 3) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def served(gw: RunningGateway) -> dict[str, float]:
    """Requests counted per pool so far (all statuses)."""
    out: dict[str, float] = {}
    for family in gw.svc.metrics.pool_requests.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                pool = s.labels["pool"]
                out[pool] = out.get(pool, 0.0) + s.value
    return out


async def pool_of(
    http: aiohttp.ClientSession, gw: RunningGateway, headers: dict[str, str] | None = None
) -> str:
    """Send one request and say which pool answered it."""
    before = served(gw)
    async with http.post(
        f"{gw.url}/v1/chat/completions", json=chat(False, max_tokens=1), headers=headers
    ) as r:
        assert r.status == 200, await r.text()
        await r.read()
    after = served(gw)
    (pool,) = [p for p in after if after[p] != before.get(p, 0.0)]
    return pool


async def test_the_split_converges_to_the_weights() -> None:
    async with fleet({"v1": 75, "v2": 25}) as gw, aiohttp.ClientSession() as http:
        n = 300

        async def one() -> int:
            async with http.post(
                f"{gw.url}/v1/chat/completions", json=chat(False, max_tokens=1)
            ) as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(one() for _ in range(n)))
        assert set(statuses) == {200}  # each sim answers only its own model name
        counts = served(gw)
        assert counts["v1"] + counts["v2"] == n
        assert abs(counts["v2"] - 75) <= 35  # about 4.7 standard deviations


async def test_alias_rewritten_upstream_and_restored_in_answers() -> None:
    async with fleet({"v2": 1}) as gw, aiohttp.ClientSession() as http:
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat(False)) as r:
            assert r.status == 200
            doc = await r.json()
        assert doc["model"] == ALIAS
        assert doc["choices"][0]["message"]["content"]
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat(True, max_tokens=20)) as r:
            assert r.status == 200
            raw = await r.read()
        events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len(chunks) >= 20
        assert {c["model"] for c in chunks} == {ALIAS}
        assert b"m-v2" not in raw
        # The pools' own names are not models unless exposed.
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat(False, "v2")) as r:
            assert r.status == 404
        async with http.get(f"{gw.url}/v1/models") as r:
            ids = {m["id"] for m in (await r.json())["data"]}
        assert ALIAS in ids
        assert "v1" not in ids


async def test_exposed_pools_are_models_of_their_own() -> None:
    rollout = {"expose_pools": True}
    async with fleet({"v1": 1}, rollout=rollout) as gw, aiohttp.ClientSession() as http:
        async with http.get(f"{gw.url}/v1/models") as r:
            ids = {m["id"] for m in (await r.json())["data"]}
        assert {ALIAS, "v1", "v2"} <= ids
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat(False, "v2")) as r:
            assert r.status == 200
            assert (await r.json())["model"] == "v2"
        assert served(gw) == {"v2": 1.0}


async def test_sessions_stay_on_their_pool_while_weights_move() -> None:
    rollout = {"sticky_header": "x-session-id"}
    async with (
        fleet({"v1": 80, "v2": 20}, rollout=rollout) as gw,
        aiohttp.ClientSession() as http,
        aiohttp.ClientSession(headers=AUTH) as admin,
    ):
        sessions = [f"s{i}" for i in range(40)]

        async def placement() -> dict[str, str]:
            return {s: await pool_of(http, gw, {"x-session-id": s}) for s in sessions}

        first = await placement()
        assert first == await placement()  # sticky at fixed weights
        assert "v2" in first.values()
        async with admin.put(f"{gw.admin_url}/admin/aliases/{ALIAS}", json={"v1": 40, "v2": 60}):
            pass
        second = await placement()
        assert all(second[s] == "v2" for s in sessions if first[s] == "v2")
        assert sum(second[s] != first[s] for s in sessions) > 0
        async with admin.post(f"{gw.admin_url}/admin/aliases/{ALIAS}/rollback") as r:
            assert (await r.json())["weights"] == {"v1": 80, "v2": 20}
        assert await placement() == first  # rolled back: exactly the movers return


async def test_rollback_takes_the_next_request_while_a_stream_on_the_old_pool_ends() -> None:
    fake = FakeBackend(models=["m"], behaviour=stream_chat(6, hold_after=2))
    async with (
        gateway_for(
            RunningSim(FAST.replace(model="m-v1")),
            fake,
            names=("v1a", "green"),
            pools=[pools()[0], {"name": "v2", "model": "m", "backends": ["green"]}],
            aliases={ALIAS: {"v1": 100}},
            admin={"token": TOKEN, "port": 0},
        ) as (gw, http),
        aiohttp.ClientSession(headers=AUTH) as admin,
    ):
        await all_up(gw)
        url = f"{gw.admin_url}/admin/aliases/{ALIAS}"
        async with admin.put(url, json={"v2": 100}) as r:
            assert r.status == 200
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat(True)) as stream:
            assert stream.status == 200
            await wait_for(lambda: len(fake.seen) == 1, what="stream on v2")
            assert json.loads(fake.seen[0].body)["model"] == "m"  # the served name upstream
            async with admin.post(f"{url}/rollback") as r:
                assert (await r.json())["weights"] == {"v1": 100}
            assert await pool_of(http, gw) == "v1"  # the very next request
            assert gw.in_flight()["green"] == 1
            fake.release.set()
            raw = await stream.read()
        events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert len(events) == 9  # role, 6 tokens, finish, [DONE]: the whole stream
        assert {json.loads(e)["model"] for e in events[:-1]} == {ALIAS}
        assert len(fake.seen) == 1


async def test_bad_changes_are_refused_and_change_nothing() -> None:
    async with (
        fleet({"v1": 95, "v2": 5}) as gw,
        aiohttp.ClientSession(headers=AUTH) as admin,
    ):
        url = f"{gw.admin_url}/admin/aliases/{ALIAS}"
        for body in ({"v3": 5}, {"v1": -1, "v2": 2}, {"v1": 0, "v2": 0}, {}, [1], {"v1": "x"}):
            async with admin.put(url, json=body) as r:
                assert r.status == 400, body
                assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with admin.post(f"{url}/rollback") as r:
            assert r.status == 400  # no previous weights yet
        async with admin.get(f"{gw.admin_url}/admin/aliases/nope") as r:
            assert r.status == 404
        async with admin.post(f"{gw.admin_url}/admin/pools/nope/drain") as r:
            assert r.status == 404
        async with admin.get(url) as r:
            doc = await r.json()
        assert doc["weights"] == {"v1": 95, "v2": 5}
        assert doc["previous"] is None


async def test_a_drained_pool_gets_no_new_requests() -> None:
    async with (
        fleet({"v1": 50, "v2": 50}) as gw,
        aiohttp.ClientSession() as http,
        aiohttp.ClientSession(headers=AUTH) as admin,
    ):
        async with admin.post(f"{gw.admin_url}/admin/pools/v2/drain") as r:
            assert r.status == 200
        async with admin.post(f"{gw.admin_url}/admin/pools/v1/drain") as r:
            assert r.status == 400  # the alias would be left with no pool
        assert {await pool_of(http, gw) for _ in range(20)} == {"v1"}
        async with admin.post(f"{gw.admin_url}/admin/pools/v2/undrain") as r:
            assert r.status == 200
        assert gw.svc.rollout.drained == set()


async def test_reload_applies_weights_live_and_refuses_a_bad_file(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"

    def write(weights: str) -> None:
        config.write_text(
            f"""
backends = [{{url = "{urls[0]}", name = "v1a"}}, {{url = "{urls[1]}", name = "v2a"}}]
[[pools]]
name = "v1"
model = "m-v1"
backends = ["v1a"]
[[pools]]
name = "v2"
model = "m-v2"
backends = ["v2a"]
[aliases]
{ALIAS} = {weights}
"""
        )

    def loader() -> Settings:
        return load_settings(config, scrape=scrape, health=health, log_level="warning")

    scrape = {"interval": 0.05, "timeout": 0.5, "stale_after": 1.0, "models_interval": 0.2}
    health = {"interval": 0.05, "timeout": 0.5}
    async with (
        running_sim(FAST.replace(model="m-v1")) as s1,
        running_sim(FAST.replace(model="m-v2")) as s2,
    ):
        urls = [s1.url, s2.url]
        write("{v1 = 100}")
        first = loader()
        async with (
            running_gateway(
                [b.model_dump() for b in first.backends],
                pools=[p.model_dump() for p in first.pools],
                aliases=first.aliases,
                loader=loader,
                admin={"token": TOKEN, "port": 0},
            ) as gw,
            aiohttp.ClientSession() as http,
            aiohttp.ClientSession(headers=AUTH) as admin,
        ):
            await all_up(gw)
            assert await pool_of(http, gw) == "v1"
            write("{v1 = 0, v2 = 100}")
            async with admin.post(f"{gw.admin_url}/admin/reload") as r:
                assert r.status == 200
                assert "aliases" in (await r.json())["applied"]
            assert await pool_of(http, gw) == "v2"
            write("{v1 = 5, v9 = 1}")
            async with admin.post(f"{gw.admin_url}/admin/reload") as r:
                assert r.status == 400
            assert gw.svc.rollout.aliases[ALIAS] == {"v1": 0, "v2": 100}
            async with admin.post(f"{gw.admin_url}/admin/aliases/{ALIAS}/rollback") as r:
                assert (await r.json())["weights"] == {"v1": 100}


async def test_hidden_pools_are_not_models_but_the_backends_own_names_are() -> None:
    """What docs/rollouts.md says of ``expose_pools = false`` (issue 23): the pool names are neither
    listed nor routable; the models the backends serve are both (a version asked by name)."""
    async with fleet({"v1": 1, "v2": 1}) as gw, aiohttp.ClientSession() as http:
        async with http.get(f"{gw.url}/v1/models") as r:
            ids = {m["id"] for m in (await r.json())["data"]}
        assert ids == {ALIAS, "m-v1", "m-v2"}
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat(False, "v2")) as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "model_not_found"
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat(False, "m-v2")) as r:
            assert r.status == 200
            assert (await r.json())["model"] == "m-v2"


async def test_pool_errors_are_exported_at_zero_before_the_first() -> None:
    async with fleet({"v1": 50, "v2": 50}) as gw, aiohttp.ClientSession() as http:
        async with http.get(f"{gw.url}/metrics") as r:
            text = await r.text()
    for pool in ("v1", "v2"):
        assert f'llm_gateway_pool_errors_total{{alias="llama",pool="{pool}"}} 0.0' in text


async def test_per_pool_metrics_are_exported() -> None:
    async with fleet({"v1": 50, "v2": 50}) as gw, aiohttp.ClientSession() as http:
        for _ in range(10):
            async with http.post(
                f"{gw.url}/v1/chat/completions", json=chat(True, max_tokens=4)
            ) as r:
                await r.read()
        async with http.get(f"{gw.url}/metrics") as r:
            text = await r.text()
        assert 'llm_gateway_pool_requests_total{alias="llama",pool=' in text
        assert 'llm_gateway_pool_time_to_first_token_seconds_count{alias="llama",pool=' in text
        assert 'llm_gateway_pool_inter_token_latency_seconds_count{alias="llama",pool=' in text


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"pools": [{"name": "v1", "model": "m", "backends": ["nope"]}]}, "unknown backend"),
        ({"pools": pools() + pools()[:1]}, "listed twice"),
        ({"pools": pools(), "aliases": {"a": {"v3": 1}}}, "unknown pool"),
        ({"pools": pools(), "aliases": {"a": {"v1": 0}}}, "all be 0"),
    ],
)
def test_settings_refuse_bad_pools_and_aliases(change: dict[str, Any], why: str) -> None:
    backends = ["http://h1:8000", {"url": "http://h2:8000", "name": "v2a"}]
    with pytest.raises(ValidationError, match=why):
        Settings(backends=[*backends, {"url": "http://h3", "name": "v1a"}], **change)


async def test_a_pool_whose_backends_are_all_down_passes_its_share_to_the_others() -> None:
    """Found by the soak: with its canary's one backend dead, an alias's canary share got
    502/503 while the stable pool was healthy. A pool nobody can serve is passed over."""
    async with fleet({"v1": 50, "v2": 50}) as gw, aiohttp.ClientSession() as http:
        pool = gw.svc.pool
        pool.set_draining("v2a", True)  # its only backend takes no request: as if it died
        pools_used = [await pool_of(http, gw) for _ in range(20)]
        pool.set_draining("v2a", False)
        back = {await pool_of(http, gw) for _ in range(20)}
    assert set(pools_used) == {"v1"}
    assert back == {"v1", "v2"}


async def test_a_pool_lost_while_the_request_waited_for_its_limits_is_chosen_again(
    own_redis: RedisServer, redis_prefix: str
) -> None:
    """Found by the soak: the alias chose the canary pool, the request then waited (here for
    a slow Redis, there for the admission queue) while the canary's only backend went down,
    and it failed with 503 although the stable pool could serve it."""
    async with AsyncExitStack() as stack:
        s1 = await stack.enter_async_context(running_sim(FAST.replace(model="m-v1")))
        s2 = await stack.enter_async_context(running_sim(FAST.replace(model="m-v2")))
        limits = {
            "store": "redis",
            # Long enough for the test's waits on any machine: no answer is not a degraded one
            "redis": {"url": own_redis.url, "key_prefix": redis_prefix, "timeout": 60.0},
            "tiers": {"default": {"requests_per_minute": 6000}},
        }
        gw = await stack.enter_async_context(
            running_gateway(
                [{"url": s1.url, "name": "v1a"}, {"url": s2.url, "name": "v2a"}],
                pools=pools(),
                aliases={ALIAS: {"v1": 1, "v2": 100_000}},  # the canary, all but surely
                limits=limits,
            )
        )
        await all_up(gw)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{gw.url}/v1/chat/completions", json=chat(False)) as r:
                assert r.status == 200  # warms the limit script into this Redis
            own_redis.pause()  # the request's limits wait for it, its pool chosen already
            try:
                sending = asyncio.create_task(
                    http.post(f"{gw.url}/v1/chat/completions", json=chat(False))
                )
                await wait_for(lambda: own_redis.unread() > 0, what="the limit script sent")
                s2.faults = replace(s2.faults, unhealthy=True)
                pool = gw.svc.pool
                await wait_for(lambda: not pool.get("v2a").up, what="the canary's backend down")  # type: ignore[union-attr]
            finally:
                own_redis.resume()
            r = await sending
            assert r.status == 200, await r.text()
            assert (await r.json())["model"] == ALIAS
            assert served(gw).get("v1") == 1.0


def test_a_pool_the_file_drains_starts_drained_and_a_reload_keeps_what_runs() -> None:
    """``[[pools]] drain = true`` (what ``state export`` writes for a drained pool) starts
    drained; a reload keeps the running pools' drains and drains a pool it adds as the file
    says."""

    def settings(*pools: dict[str, Any]) -> Settings:
        return Settings(
            backends=[{"url": "http://a:1", "name": "a"}, {"url": "http://b:1", "name": "b"}],
            pools=list(pools),
            aliases={"m": {p["name"]: 50 for p in pools}},
        )

    stable = {"name": "stable", "model": "m", "backends": ["a"]}
    canary = {"name": "canary", "model": "m", "backends": ["b"], "drain": True}
    rollout = Rollout.from_settings(settings(stable, canary))
    assert rollout.drained == {"canary"}
    rollout.set_drained("canary", False)
    rollout.reconfigure(settings(stable, canary))  # the file still says drained
    assert rollout.drained == set()  # what runs stays
    extra = {"name": "new", "model": "m", "backends": ["a"], "drain": True}
    rollout.reconfigure(settings(stable, canary, extra))
    assert rollout.drained == {"new"}  # a pool the reload adds: as the file says
