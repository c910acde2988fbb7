"""Reading a real vLLM server from outside: its /metrics and its request log."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.servers import VllmServer

RUNNING: Final = "vllm:num_requests_running"
WAITING: Final = "vllm:num_requests_waiting"
KV_USAGE: Final = "vllm:kv_cache_usage_perc"
GENERATED: Final = "vllm:generation_tokens_total"

T = TypeVar("T")


async def server_metrics(http: httpx.AsyncClient, server: VllmServer) -> dict[str, float]:
    """Every sample on the server's /metrics page, summed over labels, by sample name."""
    resp = await http.get(f"{server.url}/metrics")
    resp.raise_for_status()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def fleet_total(http: httpx.AsyncClient, servers: Sequence[VllmServer], name: str) -> float:
    """One sample summed over every server."""
    pages = await asyncio.gather(*(server_metrics(http, s) for s in servers))
    return sum(page.get(name, 0.0) for page in pages)


async def poll_until(
    probe: Callable[[], Awaitable[T]],
    done: Callable[[T], bool],
    *,
    within: float,
    what: str,
) -> tuple[T, float]:
    """Call ``probe`` until ``done`` holds for its result; return the result and when (monotonic).

    Fails after ``within`` seconds, showing the last result.
    """
    deadline = time.monotonic() + within
    while True:
        value = await probe()
        now = time.monotonic()
        if done(value):
            return value, now
        if now > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}; last: {value!r}")
        await asyncio.sleep(0.01)  # sleep-ok: polling interval of a deadline-bounded wait


def log_lines(servers: Sequence[VllmServer], *needles: str) -> list[str]:
    """Lines of the servers' logs that contain every one of ``needles``."""
    return [
        line
        for server in servers
        for line in server.log().splitlines()
        if all(n in line for n in needles)
    ]
