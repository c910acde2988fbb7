"""What the gateway learns from real vLLM servers' /metrics, and how it spreads load on them."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import httpx

from tests.e2e.observe import KV_USAGE, RUNNING, WAITING, log_lines, poll_until, server_metrics
from tests.e2e.servers import MAX_NUM_SEQS, SERVED_MODEL, VllmServer, gateway_for
from tests.helpers import RunningGateway
from tests.waiting import wait_for

# Long enough (tens of seconds of generation) to still be running when the test ends and
# cancels it; ignore_eos so a random model does not stop early.
LONG_BODY: dict[str, Any] = {
    "model": SERVED_MODEL,
    "prompt": "Keep going",
    "max_tokens": 16000,
    "ignore_eos": True,
}


@contextlib.asynccontextmanager
async def background(*calls: Awaitable[Any]) -> AsyncIterator[None]:
    """Run ``calls`` as tasks for the block; cancel them after (closing their connections)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if not isinstance(r, asyncio.CancelledError):
                raise AssertionError(f"a background request ended on its own: {r!r}")


async def test_scraped_queue_depth_and_kv_usage_match_the_servers_metrics(
    gateway: RunningGateway, servers: list[VllmServer], http: httpx.AsyncClient
) -> None:
    """One server runs its max_num_seqs requests and queues one more; the other is idle. The
    gateway's scraped load for each agrees with what each server's own /metrics says."""
    busy, idle = servers
    pool = gateway.svc.pool
    by_url = {b.spec.url: b for b in pool.all()}
    busy_state, idle_state = by_url[busy.url], by_url[idle.url]
    n = MAX_NUM_SEQS + 1

    async with httpx.AsyncClient(timeout=60.0) as direct:
        calls = [direct.post(f"{busy.url}/v1/completions", json=LONG_BODY) for _ in range(n)]
        async with background(*calls):
            page, _ = await poll_until(
                lambda: server_metrics(http, busy),
                lambda m: m.get(RUNNING) == MAX_NUM_SEQS and m.get(WAITING) == 1,
                within=35.0,  # a bound on a hang: three prefills on a starved core can take 20 s
                what=f"{MAX_NUM_SEQS} running and 1 waiting on the busy server",
            )
            kv_before = page[KV_USAGE]
            read_at = time.monotonic()

            # A scrape that began after that read: its KV figure can only be larger, since KV
            # usage only grows while the same requests keep generating.
            async def scraped_at() -> float:
                return busy_state.load_at

            await poll_until(
                scraped_at,
                lambda at: at > read_at,
                within=10.0,  # scrapes run every 0.1 s
                what="a gateway scrape of the busy server after the test's own read",
            )
            scraped = busy_state.load
            idle_scraped = idle_state.load
            kv_after = (await server_metrics(http, busy))[KV_USAGE]
            busy_page = await server_metrics(http, busy)
            idle_page = await server_metrics(http, idle)

    assert scraped is not None
    assert idle_scraped is not None
    assert (scraped.running, scraped.waiting) == (MAX_NUM_SEQS, 1)
    assert (scraped.running, scraped.waiting) == (busy_page[RUNNING], busy_page[WAITING])
    assert kv_before > 0
    assert scraped.kv_cache_usage is not None
    assert kv_before <= scraped.kv_cache_usage <= kv_after
    assert (idle_scraped.running, idle_scraped.waiting) == (0, 0)
    assert (idle_page[RUNNING], idle_page[WAITING]) == (0, 0)
    assert idle_scraped.kv_cache_usage == idle_page[KV_USAGE] == 0.0


async def streamed(client: httpx.AsyncClient, url: str, request_id: str) -> None:
    """A long stream through the gateway, read as it comes (and dropped) until cancelled, as
    a client would. (Never read, it would leave vLLM's API server merging what its engine
    generates into an ever longer pending output, and slow to answer anything else.)"""
    body = LONG_BODY | {"stream": True}
    headers = {"X-Request-Id": request_id}
    async with client.stream("POST", url, json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for _ in r.aiter_raw():
            pass


async def test_least_load_puts_concurrent_requests_on_different_servers(
    servers: list[VllmServer],
) -> None:
    """least_load counts its own in-flight requests: the second of two long ones, sent once the
    first is on its way (whatever the first's server has scraped so far), goes to the other
    server while the first is still in flight, and each server receives one of the two.

    Where each request went is read from the gateway's in-flight counts and the servers' own
    logs, not from when tokens come or what runs at one instant: on two shared cores, a
    server streaming at full speed can starve the other, or its own API server, for many
    seconds."""
    ids = [f"e2e-place-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    async with (
        gateway_for(servers, policy="least_load") as gateway,
        httpx.AsyncClient(timeout=None) as client,
    ):
        url = f"{gateway.url}/v1/completions"
        async with background(streamed(client, url, ids[0])):
            await wait_for(
                lambda: sum(gateway.in_flight().values()) == 1,
                within=15.0,  # bounds on a hang: a starved machine routes late
                what="the first request sent",
            )
            async with background(streamed(client, url, ids[1])):
                await wait_for(
                    lambda: sorted(gateway.in_flight().values()) == [1, 1],
                    within=15.0,
                    what="the second request sent, to the other server",
                )

                async def received() -> list[list[str]]:
                    return [
                        [r for r in ids if log_lines([s], "Received request", r)] for s in servers
                    ]

                got, _ = await poll_until(
                    received,
                    lambda per_server: sum(map(len, per_server)) == 2,
                    within=30.0,
                    what="both requests in the servers' logs",
                )
                assert sorted(map(len, got)) == [1, 1], got
