"""A request's priority reaches a real vLLM server that schedules by it
(``--scheduling-policy priority``): a high-priority request sent after low-priority ones that
queue inside the engine gets its first token before them.

The server runs two sequences at a time (``MAX_NUM_SEQS``): two long low-priority streams fill
it, two more low-priority ones queue in it, then the high-priority one arrives. vLLM 0.32 does
not preempt a running request for a waiting one; it takes the most important waiting request
when a slot frees. So the high one starts as soon as one of the first two ends, before either
low one queued before it. Under fcfs the same run would serve them in arrival order.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from tests.e2e.conftest import PRIORITY
from tests.e2e.observe import RUNNING, WAITING, fleet_total, poll_until
from tests.e2e.servers import E2E_HEALTH, E2E_SCRAPE, MAX_NUM_SEQS, SERVED_MODEL, VllmServer
from tests.helpers import running_gateway

LONG = 160  # tokens of the two streams that fill the server: a few seconds on one core
SHORT = 8


async def test_a_high_priority_request_overtakes_low_priority_ones_queued_in_vllm(
    servers: list[VllmServer], http: httpx.AsyncClient
) -> None:
    [server] = [s for s in servers if s.name == PRIORITY]
    backend = {"url": server.url, "scheduling": "priority"}
    tiers = {"default": {"max_priority": 10}}
    async with (
        running_gateway(
            [backend], scrape=E2E_SCRAPE, health=E2E_HEALTH, limits={"tiers": tiers}
        ) as gw,
        openai.AsyncOpenAI(
            base_url=f"{gw.url}/v1", api_key="not-checked", max_retries=0, timeout=120.0
        ) as client,
    ):
        first_token: dict[str, float] = {}

        async def stream(name: str, priority: int, tokens: int) -> None:
            s = await client.completions.create(
                model=SERVED_MODEL,
                prompt=f"Story {name}:",
                max_tokens=tokens,
                stream=True,
                extra_body={"ignore_eos": True},
                extra_headers={"x-priority": str(priority)},
            )
            async for _ in s:
                first_token.setdefault(name, time.monotonic())

        fill = [asyncio.create_task(stream(f"fill{i}", -5, LONG)) for i in range(MAX_NUM_SEQS)]
        await poll_until(
            lambda: fleet_total(http, [server], RUNNING),
            lambda n: n >= MAX_NUM_SEQS,
            within=60,
            what="the server full",
        )
        queued = [asyncio.create_task(stream(f"low{i}", -5, SHORT)) for i in range(2)]
        await poll_until(
            lambda: fleet_total(http, [server], WAITING),
            lambda n: n >= 2,
            within=60,
            what="two low-priority requests queued in the engine",
        )
        high = asyncio.create_task(stream("high", 10, SHORT))
        await poll_until(
            lambda: fleet_total(http, [server], WAITING),
            lambda n: n >= 3,
            within=60,
            what="the high-priority request queued behind them",
        )
        await asyncio.gather(*fill, *queued, high)
    assert first_token["high"] < first_token["low0"]
    assert first_token["high"] < first_token["low1"]
