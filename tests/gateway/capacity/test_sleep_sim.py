"""Capacity on simulators in vLLM's dev mode: idle engines put to sleep through their own
``/sleep``, a request held while one wakes and then served, what an operator sees and does
through the admin API."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from backends.sleep import Rest
from gateway.capacity.settings import CapacitySettings
from gateway.config.settings import Settings
from tests.helpers import Rig, gateway_for, sample, wait_for
from tools.sim import FAST, RunningSim

MODEL = "sim-model"
TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def sims(n: int, wake_time: float = 0.3) -> list[RunningSim]:
    config = dataclasses.replace(FAST, dev_mode=True, wake_time=wake_time)
    return [RunningSim(config) for _ in range(n)]


@asynccontextmanager
async def managed(
    engines: list[RunningSim], rule: dict[str, Any], **settings: Any
) -> AsyncIterator[Rig]:
    capacity = {"enabled": True, "every": 0.05, "sleep_poll": 0.05, "models": {MODEL: rule}}
    async with gateway_for(*engines, capacity=capacity, admin={"token": TOKEN}, **settings) as rig:
        yield rig


async def is_sleeping(session: aiohttp.ClientSession, sim: RunningSim) -> bool:
    async with session.get(f"{sim.url}/is_sleeping") as r:
        doc = await r.json()
    return bool(doc["is_sleeping"])


def rests(rig: Rig) -> list[Rest]:
    return [b.rest for b in rig.gw.svc.pool.all()]


async def chat(rig: Rig) -> tuple[int, str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with rig.session.post(f"{rig.gw.url}/v1/chat/completions", json=body) as r:
        return r.status, await r.text()


async def test_idle_engines_sleep_and_a_request_is_held_through_a_wake_then_served() -> None:
    engines = sims(2)
    async with managed(engines, {"min_awake": 0, "idle_before_sleep": 0.2}) as rig:
        await wait_for(
            lambda: rests(rig) == [Rest.ASLEEP, Rest.ASLEEP], within=30, what="both asleep"
        )
        assert [await is_sleeping(rig.session, s) for s in engines] == [True, True]
        status, text = await chat(rig)
        assert status == 200, text
        assert json.loads(text)["choices"][0]["message"]["content"]
        assert (
            sample(rig.gw, "llm_gateway_capacity_holds_total", model=MODEL, outcome="served") == 1
        )
        assert not all([await is_sleeping(rig.session, s) for s in engines])  # one woke


async def test_the_last_engine_stays_awake_unless_the_rule_allows_zero() -> None:
    engines = sims(3)
    async with managed(engines, {"min_awake": 1, "idle_before_sleep": 0.1}) as rig:
        await wait_for(
            lambda: sorted(r.value for r in rests(rig)) == ["asleep", "asleep", "awake"],
            within=30,
            what="two of three asleep",
        )
        slept = [await is_sleeping(rig.session, s) for s in engines]
        assert slept.count(True) == 2
        status, _ = await chat(rig)  # the one awake serves it at once: nothing held
        assert status == 200
        assert (
            sample(rig.gw, "llm_gateway_capacity_holds_total", model=MODEL, outcome="served") == 0
        )


async def test_an_operator_sleeps_and_wakes_an_engine_and_sees_it_in_the_capacity_view() -> None:
    engines = sims(2)
    # the manager keeps both awake (min_awake 2): only the operator's hand moves one
    async with managed(engines, {"min_awake": 2}) as rig:
        admin, s = rig.gw.admin_url, rig.session
        backend = rig.gw.svc.pool.all()[1].id
        async with s.post(f"{admin}/admin/backends/{backend}/sleep", headers=AUTH) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["sleep_wanted"] is True
        # the manager wants it awake again (min_awake 2): wait for the view to say so
        await wait_for(
            lambda: rests(rig) == [Rest.AWAKE, Rest.AWAKE], within=30, what="woken by the manager"
        )
        async with s.get(f"{admin}/admin/capacity", headers=AUTH) as r:
            view = await r.json()
        assert view["enabled"] is True
        assert view["managing"] is True
        assert view["rules"][MODEL]["min_awake"] == 2
        assert [e["state"] for e in view["engines"]] == ["awake", "awake"]
        async with s.put(
            f"{admin}/admin/capacity/{MODEL}",
            json={"min_awake": 1, "idle_before_sleep": 0.1},
            headers=AUTH,
        ) as r:
            assert r.status == 200, await r.text()
        await wait_for(
            lambda: sorted(r.value for r in rests(rig)) == ["asleep", "awake"],
            within=30,
            what="one asleep under the new rule",
        )
        async with s.delete(f"{admin}/admin/capacity/{MODEL}", headers=AUTH) as r:
            assert r.status == 200, await r.text()
            assert len((await r.json())["woken"]) == 1
        await wait_for(
            lambda: rests(rig) == [Rest.AWAKE, Rest.AWAKE], within=30, what="all awake, unmanaged"
        )
        assert [await is_sleeping(s, e) for e in engines] == [False, False]


async def test_a_bad_rule_is_refused_in_the_openai_shape_and_changes_nothing() -> None:
    async with managed(sims(1), {"min_awake": 1}) as rig:
        admin, s = rig.gw.admin_url, rig.session
        for bad in ({"min_awake": -1}, {"nonsense": 1}, {"min_awake": 3, "max_awake": 1}, [1]):
            async with s.put(f"{admin}/admin/capacity/{MODEL}", json=bad, headers=AUTH) as r:
                assert r.status == 400, bad
                assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with s.get(f"{admin}/admin/capacity", headers=AUTH) as r:
            assert (await r.json())["rules"][MODEL]["min_awake"] == 1
        async with s.post(f"{admin}/admin/backends/nope/sleep", headers=AUTH) as r:
            assert r.status == 404


async def test_a_reload_applies_the_files_rules_and_says_the_rest_needs_a_restart() -> None:
    engines = sims(2)
    loaded: list[Settings] = []

    def loader() -> Settings:
        return loaded[-1]

    async with managed(engines, {"min_awake": 2}, loader=loader) as rig:
        admin, s = rig.gw.admin_url, rig.session
        current = rig.gw.svc.config.current
        capacity = current.capacity.model_dump()
        capacity["models"] = {MODEL: {"min_awake": 1, "idle_before_sleep": 0.1}}
        loaded.append(current.model_copy(update={"capacity": CapacitySettings(**capacity)}))
        async with s.post(f"{admin}/admin/reload", headers=AUTH) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["applied"] == ["capacity"]
        await wait_for(
            lambda: sorted(r.value for r in rests(rig)) == ["asleep", "awake"],
            within=30,
            what="one asleep under the file's new rule",
        )
        capacity["every"] = 0.5
        loaded.append(current.model_copy(update={"capacity": CapacitySettings(**capacity)}))
        async with s.post(f"{admin}/admin/reload", headers=AUTH) as r:
            assert (await r.json())["restart_required"] == ["capacity"]


async def test_engines_without_dev_mode_are_never_put_to_sleep() -> None:
    engines = [RunningSim(FAST), RunningSim(FAST)]  # no /is_sleeping: vLLM without dev mode
    async with managed(engines, {"min_awake": 0, "idle_before_sleep": 0.05}) as rig:
        manager = rig.gw.svc.manager
        assert manager is not None
        turns = manager.turns
        await wait_for(lambda: manager.turns >= turns + 10, within=30, what="ten turns")
        assert rests(rig) == [Rest.AWAKE, Rest.AWAKE]
        assert sum(manager.decisions.values()) == 0
        status, _ = await chat(rig)
        assert status == 200
