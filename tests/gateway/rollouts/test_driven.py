"""A progressive rollout driven by the gateway itself, on simulators: started through the admin
API, promoted step by step while the canary keeps to its gates, rolled back and drained at once
when it errs, held while paused; each step made once and recorded."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

from gateway.config.settings import Settings, load_settings
from tests.helpers import RunningGateway, running_gateway, wait_for
from tools.sim import FAST, RunningSim, running_sim
from tools.sim.faults import Faults

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ALIAS = "llama"
# Latency gates wide open: two simulators of one speed on a busy test machine differ by chance;
# the error gate and the steps are what these tests are about.
PLAN: dict[str, Any] = {
    "stable": "v1",
    "canary": "v2",
    "steps": [10, 50, 100],
    "hold_s": 0.2,
    "min_requests": 3,
    "gates": {"error_margin": 0.05, "ttft_p99_factor": 1000, "itl_p50_factor": 1000},
}


@asynccontextmanager
async def fleet(
    canary_seed: int | None = None,
) -> AsyncIterator[tuple[RunningGateway, RunningSim, RunningSim]]:
    """One simulator per version, pools v1 (stable) and v2 (canary) behind ``llama``;
    ``canary_seed``: the canary's answers from another seed (fast, and wrong)."""
    async with AsyncExitStack() as stack:
        s1 = await stack.enter_async_context(running_sim(FAST.replace(model="m-v1")))
        v2 = FAST.replace(model="m-v2")
        if canary_seed is not None:
            v2 = v2.replace(seed=canary_seed)
        s2 = await stack.enter_async_context(running_sim(v2))
        gw = await stack.enter_async_context(
            running_gateway(
                [{"url": s1.url, "name": "v1a"}, {"url": s2.url, "name": "v2a"}],
                pools=[
                    {"name": "v1", "model": "m-v1", "backends": ["v1a"]},
                    {"name": "v2", "model": "m-v2", "backends": ["v2a"]},
                ],
                aliases={ALIAS: {"v1": 100, "v2": 0}},
                admin={"token": TOKEN, "port": 0},
                rollout={"drive_every": 0.02},
            )
        )
        yield gw, s1, s2


@asynccontextmanager
async def traffic(gw: RunningGateway) -> AsyncIterator[list[int]]:
    """Requests for the alias, one after another, until the block ends; their statuses."""
    statuses: list[int] = []
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def send(http: aiohttp.ClientSession) -> None:
        while True:
            async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
                await r.read()
                statuses.append(r.status)

    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(send(http))
        try:
            yield statuses
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def status(gw: RunningGateway) -> str | None:
    run = gw.svc.rollouts.now.get(ALIAS)
    return None if run is None else run.status


async def start(http: aiohttp.ClientSession, gw: RunningGateway, plan: dict[str, Any]) -> Any:
    async with http.post(f"{gw.admin_url}/admin/rollouts/{ALIAS}", json=plan, headers=AUTH) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_a_healthy_canary_is_promoted_through_every_step_once() -> None:
    async with fleet() as (gw, _s1, _s2), aiohttp.ClientSession() as http:
        started = await start(http, gw, PLAN)
        assert started["weights"] == {"v1": 90.0, "v2": 10.0}
        assert gw.svc.rollout.aliases[ALIAS] == {"v1": 90.0, "v2": 10.0}
        async with traffic(gw) as statuses:
            await wait_for(lambda: status(gw) == "promoted", within=60, what="promoted")
        assert set(statuses) == {200}
        run = gw.svc.rollouts.now.get(ALIAS)
        assert run is not None
        assert [(e.action, e.step) for e in run.history] == [
            ("start", 0),
            ("advance", 1),
            ("advance", 2),
            ("promote", 2),
        ]
        last = run.history[-1]
        assert all(r["passed"] for r in last.readings)
        assert {r["gate"] for r in last.readings} >= {"errors", "ttft_p99", "itl_p50"}
        assert gw.svc.rollout.aliases[ALIAS] == {"v2": 100.0}
        assert gw.svc.metrics.rollout_share.labels(ALIAS)._value.get() == 100.0
        async with http.get(f"{gw.admin_url}/admin/rollouts/{ALIAS}", headers=AUTH) as r:
            view = await r.json()
        assert view["status"] == "promoted"
        assert [e["action"] for e in view["history"]] == ["start", "advance", "advance", "promote"]


async def test_a_canary_that_errs_is_rolled_back_and_drained_at_once() -> None:
    async with fleet() as (gw, _s1, s2), aiohttp.ClientSession() as http:
        s2.faults = Faults(error_rate=0.5, error_status=500)
        await start(http, gw, PLAN)
        async with traffic(gw):
            await wait_for(lambda: status(gw) == "aborted", within=60, what="aborted")
        run = gw.svc.rollouts.now.get(ALIAS)
        assert run is not None
        assert run.step == 0  # it never left the first step
        abort = run.history[-1]
        assert abort.action == "abort"
        assert abort.why == "gate(s) failed: errors"
        [errors] = [r for r in abort.readings if r["gate"] == "errors"]
        assert not errors["passed"]
        assert errors["canary"] > errors["limit"]
        assert gw.svc.rollout.aliases[ALIAS] == {"v1": 100.0, "v2": 0.0}
        assert "v2" in gw.svc.rollout.drained  # until someone acts
        aborts = gw.svc.metrics.rollout_aborts.labels(ALIAS, "errors")._value.get()
        assert aborts == 1
        async with traffic(gw) as statuses:  # the alias is the stable pool's alone again
            await wait_for(lambda: len(statuses) >= 10, what="ten requests")
        assert set(statuses) == {200}


PROBED: dict[str, Any] = {
    **PLAN,
    "probes": ["Tell me about the sea.", "Count to ten."],
    "probe_tokens": 12,
    "gates": {**PLAN["gates"], "min_agreement": 0.9},
}


async def test_a_canary_that_answers_differently_is_rolled_back_by_the_probes() -> None:
    async with fleet(canary_seed=7) as (gw, _s1, _s2), aiohttp.ClientSession() as http:
        await start(http, gw, PROBED)
        async with traffic(gw) as statuses:
            await wait_for(lambda: status(gw) == "aborted", within=60, what="aborted")
        assert set(statuses) == {200}  # fast and without an error: only the probes tell
        run = gw.svc.rollouts.now.get(ALIAS)
        assert run is not None
        abort = run.history[-1]
        assert abort.why == "gate(s) failed: probes"
        [probes] = [r for r in abort.readings if r["gate"] == "probes"]
        assert probes["canary"] < 0.5  # another seed: hardly a word in common
        assert probes["limit"] == 0.9


async def test_a_canary_that_answers_alike_passes_the_probes() -> None:
    async with fleet() as (gw, _s1, _s2), aiohttp.ClientSession() as http:
        await start(http, gw, PROBED)
        async with traffic(gw):
            await wait_for(lambda: status(gw) == "promoted", within=60, what="promoted")
        run = gw.svc.rollouts.now.get(ALIAS)
        assert run is not None
        for event in run.history[1:]:  # every step judged on the probes too, and passed
            [probes] = [r for r in event.readings if r["gate"] == "probes"]
            assert probes["canary"] == 1.0
            assert probes["passed"]


async def test_a_paused_rollout_holds_its_step_and_goes_on_when_resumed() -> None:
    async with fleet() as (gw, _s1, _s2), aiohttp.ClientSession() as http:
        await start(http, gw, PLAN)
        async with http.post(f"{gw.admin_url}/admin/rollouts/{ALIAS}/pause", headers=AUTH) as r:
            assert r.status == 200, await r.text()
        async with traffic(gw) as statuses:
            await wait_for(lambda: len(statuses) >= 60, within=30, what="sixty requests")
            run = gw.svc.rollouts.now.get(ALIAS)
            assert run is not None
            assert (run.status, run.step) == ("paused", 0)  # enough requests, held anyway
            async with http.post(
                f"{gw.admin_url}/admin/rollouts/{ALIAS}/resume", headers=AUTH
            ) as r:
                assert r.status == 200, await r.text()
            await wait_for(lambda: status(gw) == "promoted", within=60, what="promoted")


async def test_bad_rollouts_are_refused_and_change_nothing() -> None:
    async with fleet() as (gw, _s1, _s2), aiohttp.ClientSession() as http:
        url = f"{gw.admin_url}/admin/rollouts/{ALIAS}"
        for plan, code, says in (
            ({**PLAN, "canary": "v3"}, 400, "unknown pool(s): v3"),
            ({**PLAN, "steps": [50, 10]}, 400, "must rise"),
            ({**PLAN, "hold_s": "long"}, 400, "hold_s must be a number"),
            ({**PLAN, "surprise": 1}, 400, "unknown field(s): surprise"),
        ):
            async with http.post(url, json=plan, headers=AUTH) as r:
                assert r.status == code
                assert says in (await r.json())["error"]["message"]
        async with http.post(f"{gw.admin_url}/admin/rollouts/nope", json=PLAN, headers=AUTH) as r:
            assert r.status == 404
        assert gw.svc.rollouts.now.get(ALIAS) is None
        assert gw.svc.rollout.aliases[ALIAS] == {"v1": 100.0, "v2": 0.0}
        await start(http, gw, {**PLAN, "hold_s": 3600})
        async with http.post(url, json=PLAN, headers=AUTH) as r:
            assert r.status == 409  # one under way already
        async with http.post(f"{url}/resume", headers=AUTH) as r:
            assert r.status == 409  # not paused
        async with http.post(f"{url}/decision", json={"action": "promote"}, headers=AUTH) as r:
            assert r.status in (404, 405)  # the driver's alone: not an admin route
        async with http.post(url, json=PLAN) as r:
            assert r.status == 401  # admin functions are never open
        run = gw.svc.rollouts.now.get(ALIAS)
        assert run is not None
        assert (run.status, run.step) == ("running", 0)


# Judged at once: no request needed, a hold of 10 ms
QUICK: dict[str, Any] = {**PLAN, "steps": [50, 100], "hold_s": 0.01, "min_requests": 0}


async def test_a_rollback_after_a_promotion_goes_back_to_the_split_before_the_rollout() -> None:
    """Issue 54: after a promotion ``previous`` was the last step's {v1: 0, v2: 100}, so a
    rollback changed nothing. A rollout is one change of its alias: a rollback goes back to
    the split before it began, and a second one forward to the promotion's."""
    async with fleet() as (gw, _s1, _s2), aiohttp.ClientSession(headers=AUTH) as http:
        alias = f"{gw.admin_url}/admin/aliases/{ALIAS}"
        await start(http, gw, QUICK)
        await wait_for(lambda: status(gw) == "promoted", within=30, what="promoted")
        async with http.get(alias) as r:
            doc = await r.json()
        assert (doc["weights"], doc["previous"]) == ({"v2": 100.0}, {"v1": 100.0, "v2": 0.0})
        async with http.post(f"{alias}/rollback") as r:
            assert r.status == 200, await r.text()
            doc = await r.json()
        assert (doc["weights"], doc["previous"]) == ({"v1": 100.0, "v2": 0.0}, {"v2": 100.0})
        assert gw.svc.rollout.aliases[ALIAS] == {"v1": 100.0, "v2": 0.0}
        async with http.post(f"{alias}/rollback") as r:
            assert (await r.json())["weights"] == {"v2": 100.0}


async def test_a_rollback_is_refused_while_a_rollout_is_under_way() -> None:
    """The rollout moves the alias's weights itself: a rollback under it would leave it judging
    a canary without traffic. Refused (409, saying to abort), nothing changed; once it has
    been aborted, the rollback is the alias's as any other."""
    async with fleet() as (gw, _s1, _s2), aiohttp.ClientSession(headers=AUTH) as http:
        alias = f"{gw.admin_url}/admin/aliases/{ALIAS}"
        await start(http, gw, {**PLAN, "hold_s": 3600})
        async with http.post(f"{alias}/rollback") as r:
            assert r.status == 409
            assert "abort it" in (await r.json())["error"]["message"]
        assert gw.svc.rollout.aliases[ALIAS] == {"v1": 90.0, "v2": 10.0}
        assert gw.svc.rollout.previous[ALIAS] == {"v1": 100.0, "v2": 0.0}
        async with http.post(f"{gw.admin_url}/admin/rollouts/{ALIAS}/abort") as r:
            assert r.status == 200, await r.text()
        async with http.post(f"{alias}/rollback") as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["weights"] == {"v1": 100.0, "v2": 0.0}


async def test_the_history_says_who_started_paused_resumed_and_aborted_a_rollout() -> None:
    """Issue 54: the start's ``by`` was empty (an operator's pause, resume and abort too): each
    is the caller, as the audit trail has it."""
    async with fleet() as (gw, _s1, _s2), aiohttp.ClientSession(headers=AUTH) as http:
        url = f"{gw.admin_url}/admin/rollouts/{ALIAS}"
        plan = {**PLAN, "hold_s": 3600}
        async with http.post(url, json=plan, headers={"X-Admin-Caller": "alice"}) as r:
            assert r.status == 200, await r.text()
        for verb in ("pause", "resume", "abort"):
            async with http.post(f"{url}/{verb}", headers={"X-Admin-Caller": "bob"}) as r:
                assert r.status == 200, await r.text()
        async with http.get(url) as r:
            history = (await r.json())["history"]
    assert [(e["action"], e["by"]) for e in history] == [
        ("start", "alice (127.0.0.1)"),
        ("pause", "bob (127.0.0.1)"),
        ("resume", "bob (127.0.0.1)"),
        ("abort", "bob (127.0.0.1)"),
    ]


async def test_a_plan_in_the_file_starts_itself_and_a_reload_leaves_its_weights(
    tmp_path: Path,
) -> None:
    """The configuration file's plan is started by the gateway itself; a reload of a file whose
    weights and plan changed meanwhile moves neither the rollout's weights nor starts the new
    plan while the first runs; once that one ends, the new plan starts (once)."""
    config = tmp_path / "gateway.toml"
    slow = {**PLAN, "hold_s": 600}  # held at its first step while the test looks

    def write(weights: str, plan: dict[str, Any]) -> None:
        gates = ", ".join(f"{k} = {v}" for k, v in plan["gates"].items())
        config.write_text(
            f"""
backends = [{{url = "{urls[0]}", name = "v1a"}}, {{url = "{urls[1]}", name = "v2a"}}]
pools = [
  {{ name = "v1", model = "m-v1", backends = ["v1a"] }},
  {{ name = "v2", model = "m-v2", backends = ["v2a"] }},
]
aliases = {{ {ALIAS} = {weights} }}
[rollout]
drive_every = 0.02
[rollout.plans.{ALIAS}]
stable = "v1"
canary = "v2"
steps = {plan["steps"]}
hold_s = {plan["hold_s"]}
min_requests = {plan["min_requests"]}
gates = {{ {gates} }}
"""
        )

    def loader() -> Settings:
        return load_settings(config, log_level="warning")

    async with (
        running_sim(FAST.replace(model="m-v1")) as s1,
        running_sim(FAST.replace(model="m-v2")) as s2,
    ):
        urls = [s1.url, s2.url]
        write("{ v1 = 100 }", slow)
        first = loader()
        async with (
            running_gateway(
                [b.model_dump() for b in first.backends],
                pools=[p.model_dump() for p in first.pools],
                aliases=first.aliases,
                rollout=first.rollout.model_dump(),
                loader=loader,
                admin={"token": TOKEN, "port": 0},
            ) as gw,
            aiohttp.ClientSession(headers=AUTH) as admin,
        ):
            await wait_for(lambda: status(gw) == "running", within=30, what="started by itself")
            assert gw.svc.rollout.aliases[ALIAS] == {"v1": 90.0, "v2": 10.0}
            changed = {**slow, "steps": [20, 100]}
            write("{ v1 = 50, v2 = 50 }", changed)
            async with admin.post(f"{gw.admin_url}/admin/reload") as r:
                assert r.status == 200, await r.text()
                assert {"aliases", "rollout"} <= set((await r.json())["applied"])
            # The rollout owns the alias's weights while it runs; its plan is the one started.
            assert gw.svc.rollout.aliases[ALIAS] == {"v1": 90.0, "v2": 10.0}
            run = gw.svc.rollouts.now.get(ALIAS)
            assert run is not None
            assert run.plan.steps == (10.0, 50.0, 100.0)
            async with admin.post(f"{gw.admin_url}/admin/rollouts/{ALIAS}/abort") as r:
                assert r.status == 200, await r.text()
            await wait_for(
                lambda: (
                    (r := gw.svc.rollouts.now.get(ALIAS)) is not None
                    and r.plan.steps == (20.0, 100.0)
                ),
                within=30,
                what="the changed plan started once the first ended",
            )
            assert gw.svc.rollout.aliases[ALIAS] == {"v1": 80.0, "v2": 20.0}
            run = gw.svc.rollouts.now.get(ALIAS)
            assert run is not None
            assert [(e.action, e.by) for e in run.history] == [("start", "configuration")]
