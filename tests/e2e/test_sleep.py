"""Capacity on a real vLLM server (the CPU build, dev mode): the gateway puts it to sleep when
idle, requests that arrive meanwhile are held and served once it is woken, and the server's
own ``/is_sleeping`` confirms each state.

On the CPU build ``/sleep`` only pauses the engine's scheduling (real memory release needs
CUDA), which is what the protocol needs: a request sent to it while asleep would wait inside
it; the gateway must not send one there, and must wake it for the held ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from backends.sleep import Rest
from tests.e2e.servers import SERVED_MODEL, VllmServer, gateway_for
from tests.helpers import RunningGateway, wait_for

RULE = {"min_awake": 0, "idle_before_sleep": 0.5, "wake_time": 2.0, "wake_timeout": 60.0}
CAPACITY = {"enabled": True, "every": 0.2, "sleep_poll": 0.1, "models": {SERVED_MODEL: RULE}}


async def is_sleeping(http: httpx.AsyncClient, server: VllmServer) -> bool:
    r = await http.get(f"{server.url}/is_sleeping")
    r.raise_for_status()
    return bool(r.json()["is_sleeping"])


@pytest.fixture
async def managed(
    servers: list[VllmServer], http: httpx.AsyncClient
) -> AsyncIterator[tuple[RunningGateway, VllmServer]]:
    """One server behind a gateway that manages its capacity; awake again afterwards, whatever
    happened (the other tests share it)."""
    server = servers[0]
    try:
        async with gateway_for([server], capacity=CAPACITY) as gw:
            yield gw, server
    finally:
        await http.post(f"{server.url}/wake_up")
        assert not await is_sleeping(http, server)


def holds(gw: RunningGateway, outcome: str) -> float:
    value = gw.svc.metrics.registry.get_sample_value(
        "llm_gateway_capacity_holds_total", {"model": SERVED_MODEL, "outcome": outcome}
    )
    return value or 0.0


async def test_an_idle_server_sleeps_and_requests_meanwhile_are_held_then_served(
    managed: tuple[RunningGateway, VllmServer], http: httpx.AsyncClient
) -> None:
    gw, server = managed
    backend = gw.svc.pool.all()[0]
    await wait_for(lambda: backend.rest is Rest.ASLEEP, within=60, what="the idle server asleep")
    assert await is_sleeping(http, server)  # the server says so, not only the gateway
    async with openai.AsyncOpenAI(
        base_url=f"{gw.url}/v1", api_key="not-checked", max_retries=0, timeout=120.0
    ) as client:
        answers = await asyncio.gather(
            *(
                client.completions.create(model=SERVED_MODEL, prompt=f"Hello {i}", max_tokens=4)
                for i in range(3)
            )
        )
    assert all(a.choices[0].text is not None and a.usage is not None for a in answers)
    assert holds(gw, "served") >= 1  # the first at least: it asked for the wake
    assert holds(gw, "timed_out") == 0
    assert not await is_sleeping(http, server)  # woken for them
    # idle again: back to sleep, as the server confirms
    await wait_for(lambda: backend.rest is Rest.ASLEEP, within=60, what="asleep once idle again")
    assert await is_sleeping(http, server)
