"""A request's own TTFT objective (``x-ttft-slo-ms``) through a running gateway."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import aiohttp

from policies import Outcome
from policies.latency import Load
from tests.helpers import RunningGateway, fronting, sample, wait_for
from tools.sim import FAST, Faults, RunningSim

# One backend, 40 ms a step: no first token comes within a few milliseconds.
SLOW = replace(FAST, step_base_ms=5.0)
BODY: dict[str, Any] = {
    "model": "sim-model",
    "max_tokens": 2,
    "stream": True,
    "messages": [{"role": "user", "content": "quick!"}],
}


@asynccontextmanager
async def gateway(*, queue: bool) -> AsyncIterator[RunningGateway]:
    limits: dict[str, Any] = {"tiers": {"default": {"max_priority": 1}}}
    if queue:
        limits["admission"] = {"enabled": True, "max_wait": 0.3, "retry_after": 2}
    async with fronting(
        RunningSim(SLOW, faults=Faults(slowdown=8.0)), policy="predicted_latency", limits=limits
    ) as gw:
        await wait_for(gw.ready, what="gateway ready")
        yield gw


async def post(
    s: aiohttp.ClientSession, gw: RunningGateway, **headers: str
) -> aiohttp.ClientResponse:
    async with s.post(gw.url + "/v1/chat/completions", json=BODY, headers=headers) as r:
        await r.read()
        return r


async def learn(s: aiohttp.ClientSession, gw: RunningGateway, n: int = 10) -> None:
    for _ in range(n):
        assert (await post(s, gw)).status == 200
    assert gw.svc.latency.view(gw.svc.latency.backends()[0]).observed == n


def slo(gw: RunningGateway, outcome: str) -> float:
    return sample(gw, "llm_gateway_slo_requests_total", outcome=outcome)


async def test_an_objective_no_backend_is_predicted_to_meet_is_shed_at_priority_zero() -> None:
    async with gateway(queue=True) as gw, aiohttp.ClientSession() as s:
        await learn(s, gw)
        async with s.post(
            gw.url + "/v1/chat/completions", json=BODY, headers={"x-ttft-slo-ms": "2"}
        ) as r:
            assert r.status == 503
            assert r.headers["Retry-After"] == "2"
            err = (await r.json())["error"]
        assert err["code"] == "slo_unmeetable"
        assert "2 ms" in err["message"]
        assert slo(gw, "shed") == 1
        # At a higher priority it is served, late.
        late = await post(s, gw, **{"x-ttft-slo-ms": "2", "x-priority": "1"})
        assert late.status == 200
        assert slo(gw, "late") == 1
        # An objective the backend is predicted to meet goes straight on.
        met = await post(s, gw, **{"x-ttft-slo-ms": "60000"})
        assert met.status == 200
        assert slo(gw, "met") == 1
        assert set(gw.in_flight().values()) == {0}


async def test_without_the_admission_queue_an_unmeetable_objective_is_served_and_counted() -> None:
    async with gateway(queue=False) as gw, aiohttp.ClientSession() as s:
        await learn(s, gw)
        r = await post(s, gw, **{"x-ttft-slo-ms": "2"})
        assert r.status == 200
        assert slo(gw, "unmet") == 1
        assert slo(gw, "shed") == 0


async def test_a_malformed_objective_is_a_400_and_nothing_is_counted() -> None:
    async with gateway(queue=True) as gw, aiohttp.ClientSession() as s:
        for bad in ("soon", "-5", "0", "nan", "1e12"):
            async with s.post(
                gw.url + "/v1/chat/completions", json=BODY, headers={"x-ttft-slo-ms": bad}
            ) as r:
                assert r.status == 400, bad
                err = (await r.json())["error"]
                assert err["type"] == "invalid_request_error"
                assert "milliseconds" in err["message"]
        assert sum(slo(gw, o) for o in ("met", "unmet", "waited", "late", "shed")) == 0
        assert gw.svc.latency.backends() == []  # no request reached a backend


async def test_a_request_waits_for_the_fleet_to_change_until_its_objective_is_predicted_met() -> (
    None
):
    async with gateway(queue=True) as gw, aiohttp.ClientSession() as s:
        gw.svc.settings.limits.admission.max_wait = 5.0
        await learn(s, gw)
        call = asyncio.ensure_future(post(s, gw, **{"x-ttft-slo-ms": "20"}))
        await asyncio.sleep(0.2)  # sleep-ok: it is waiting (nothing reached the backend)
        assert not call.done()
        assert slo(gw, "waited") == 0
        # The backend turns out fast (as if its recent answers had come in 1 ms), and the
        # pool says capacity may have changed: the waiter predicts again and goes.
        tracker = gw.svc.latency
        backend = tracker.backends()[0]
        fast = Outcome(ok=True, status=200, first_token_s=0.001, tokens=2, duration_s=0.002)
        for _ in range(200):
            tracker.observe(backend, Load(uncached=4), fast)
        gw.svc.pool.changed()
        r = await asyncio.wait_for(call, 2.0)
        assert r.status == 200
        assert slo(gw, "waited") == 1
