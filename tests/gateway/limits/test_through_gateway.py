"""Keys, limits and the admission queue, end to end through running gateways."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.limits.keys import hash_key
from tests.helpers import (
    FakeBackend,
    Seen,
    chat_chunk,
    running_fake,
    running_gateway,
    stream_chat,
    wait_for,
)
from tests.redis_server import RedisServer

ALICE, BOB = "sk-alice-123", "sk-bob-456"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}


def limits(tier: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "auth": True,
        "tiers": {"default": tier},
        "keys": [
            {"name": "alice", "hash": hash_key(ALICE)},
            {"name": "bob", "hash": hash_key(BOB)},
        ],
        **extra,
    }


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def burst(
    s: aiohttp.ClientSession, urls: list[str], n: int, key: str, body: Any = CHAT
) -> Counter[int]:
    async def one(i: int) -> int:
        url = urls[i % len(urls)]
        async with s.post(url + "/v1/chat/completions", json=body, headers=auth(key)) as r:
            await r.read()
            return r.status

    return Counter(await asyncio.gather(*(one(i) for i in range(n))))


async def test_missing_or_unknown_key_is_401_and_the_key_never_reaches_a_backend() -> None:
    fake = FakeBackend()
    async with (
        running_fake(fake),
        running_gateway([fake.url], limits=limits({})) as gw,
        aiohttp.ClientSession() as s,
    ):
        for headers in ({}, auth("sk-wrong"), {"x-api-key": "nope"}):
            async with s.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers) as r:
                assert r.status == 401
                err = (await r.json())["error"]
                assert err["type"] == "authentication_error"
        async with s.post(gw.url + "/v1/chat/completions", json=CHAT, headers=auth(ALICE)) as r:
            assert r.status == 200
        async with s.post(
            gw.url + "/v1/chat/completions", json=CHAT, headers={"x-api-key": BOB}
        ) as r:
            assert r.status == 200
    assert len(fake.seen) == 2
    for seen in fake.seen:
        sent = json.dumps(dict(seen.headers))
        assert ALICE not in sent
        assert BOB not in sent


async def test_one_process_memory_store_holds_the_request_limit_under_a_burst() -> None:
    fake = FakeBackend()
    async with (
        running_fake(fake),
        running_gateway([fake.url], limits=limits({"requests_per_minute": 10})) as gw,
        aiohttp.ClientSession() as s,
    ):
        statuses = await burst(s, [gw.url], 40, ALICE)
        other = await burst(s, [gw.url], 3, BOB)  # bob has his own budget
        async with s.post(gw.url + "/v1/chat/completions", json=CHAT, headers=auth(ALICE)) as r:
            assert r.status == 429
            err = (await r.json())["error"]
            headers = r.headers
    assert statuses[200] == 10
    assert statuses[429] == 30
    assert other == Counter({200: 3})
    assert err["code"] == "rate_limit_exceeded"
    assert int(headers["Retry-After"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "10"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-reset-requests" in headers


async def test_token_budget_cannot_be_overspent_by_concurrent_requests() -> None:
    # Each request reserves ~1 prompt token + 100 completion tokens: 5 fit in 550.
    fake = FakeBackend(behaviour=stream_chat(2, delay=0.05))
    body = CHAT | {"max_tokens": 100, "stream": True}
    async with (
        running_fake(fake),
        running_gateway([fake.url], limits=limits({"tokens_per_minute": 550})) as gw,
        aiohttp.ClientSession() as s,
    ):
        statuses = await burst(s, [gw.url], 20, ALICE, body)
    assert statuses[200] == 5
    assert statuses[429] == 15


_DRAINS: set[asyncio.Task[bytes]] = set()


async def start_gateway_process(config: Path) -> tuple[asyncio.subprocess.Process, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", "0",
        env=env | {"GATEWAY_LOG_FORMAT": "json"},
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
        assert line, "gateway exited before listening"
        m = re.search(r'"address": ?"(http://127\.0\.0\.1:\d+)"', line)
        if m:
            # Read on to the end: a full pipe would block the gateway's next log line (and
            # with it its event loop, SIGTERM included).
            drain = asyncio.create_task(proc.stderr.read())
            _DRAINS.add(drain)
            drain.add_done_callback(_DRAINS.discard)
            return proc, m.group(1)


async def test_two_gateway_processes_share_one_keys_limits_through_redis(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    fake = FakeBackend()
    async with running_fake(fake):
        config = tmp_path / "gw.toml"
        config.write_text(
            f'backends = ["{fake.url}"]\n'
            '[limits]\nauth = true\nstore = "redis"\n'
            "[limits.redis]\n"
            f'url = "{redis_url}"\nkey_prefix = "{redis_prefix}"\ntimeout = 1.0\n'
            "[limits.tiers.default]\nrequests_per_minute = 12\ntokens_per_minute = 100000\n"
            f'[[limits.keys]]\nname = "alice"\nhash = "{hash_key(ALICE)}"\n'
        )
        procs = [await start_gateway_process(config) for _ in range(2)]
        try:
            async with aiohttp.ClientSession() as s:
                statuses = await burst(s, [url for _, url in procs], 60, ALICE)
        finally:
            for proc, _ in procs:
                proc.terminate()
                await proc.wait()
    # 12 a minute for the key across both processes; a burst of a few seconds may see one
    # more token refill (12/60 per second), never the 24 two separate limits would allow.
    assert 12 <= statuses[200] <= 13
    assert statuses[200] + statuses[429] == 60
    assert len(fake.seen) == statuses[200]


async def store_figures(
    s: aiohttp.ClientSession, url: str, key: str = "key:alice"
) -> tuple[float, float]:
    """``llm_gateway_limits_store_up`` and ``key``'s ``..._degraded_admissions_total`` from
    /metrics (every principal's series is there, from 0)."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    up = re.search(r"^llm_gateway_limits_store_up (\S+)$", text, re.M)
    name = "llm_gateway_limits_degraded_admissions_total"
    degraded = dict(re.findall(rf'^{name}\{{key="([^"]*)"\}} (\S+)$', text, re.M))
    assert up is not None, text
    assert "anonymous" in degraded, text
    return float(up.group(1)), float(degraded[key])


@pytest.mark.parametrize("mode", ["closed", "open"])
async def test_redis_outage_follows_the_failure_mode_and_recovers(
    own_redis: RedisServer, mode: str
) -> None:
    fake = FakeBackend()
    config = limits(
        {"requests_per_minute": 3},
        store="redis",
        # A down server refuses at once; the timeout bounds the reconnection after it is back
        # (0.1 s was too short for that on a busy machine: requests failed closed with 503).
        redis={"url": own_redis.url, "failure_mode": mode, "timeout": 0.5, "retry_interval": 0},
    )
    async with (
        running_fake(fake),
        running_gateway([fake.url], limits=config) as gw,
        aiohttp.ClientSession() as s,
    ):
        assert await burst(s, [gw.url], 1, ALICE) == Counter({200: 1})
        before = await store_figures(s, gw.url)
        own_redis.stop()
        during = await burst(s, [gw.url], 5, ALICE)  # a hung request fails the test's timeout
        down = await store_figures(s, gw.url)
        own_redis.start()
        # Back: the key's bucket was lost with the old server, so a fresh limit of 3 holds.
        after = await burst(s, [gw.url], 6, ALICE)
        back = await store_figures(s, gw.url)
    if mode == "closed":
        assert during == Counter({503: 5})
    else:
        assert during == Counter({200: 5})  # admitted unchecked, and logged
    # What the "limits degraded" alert reads: the store's state, and admissions unchecked.
    degraded = 5.0 if mode == "open" else 0.0
    assert before == (1.0, 0.0)
    assert down == (0.0, degraded)
    assert back == (1.0, degraded)
    assert after == Counter({200: 3, 429: 3})


async def test_usage_chunk_is_asked_for_upstream_and_hidden_from_a_client_that_did_not() -> None:
    async def with_usage(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        doc = json.loads(seen.body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chat_chunk(role=True) + chat_chunk("a") + chat_chunk(finish="stop"))
        if (doc.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode())
            await resp.write(b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    fake = FakeBackend(behaviour=with_usage)
    body = CHAT | {"stream": True}
    async with (
        running_fake(fake),
        running_gateway([fake.url], limits=limits({"tokens_per_minute": 10_000})) as gw,
        aiohttp.ClientSession() as s,
    ):
        async with s.post(gw.url + "/v1/chat/completions", json=body, headers=auth(ALICE)) as r:
            plain = await r.read()
        asked = body | {"stream_options": {"include_usage": True}}
        async with s.post(gw.url + "/v1/chat/completions", json=asked, headers=auth(ALICE)) as r:
            with_it = await r.read()
    assert json.loads(fake.seen[0].body)["stream_options"] == {"include_usage": True}
    assert b'"usage"' not in plain
    assert plain.endswith(b"data: [DONE]\n\n")
    assert b'"usage"' in with_it


async def test_queue_serves_a_quiet_key_before_a_bursting_one_and_times_out() -> None:
    fake = FakeBackend(behaviour=stream_chat(2, delay=0.03))
    config = limits(
        {},
        admission={"enabled": True, "max_in_flight": 1, "max_wait": 5, "max_size": 50},
    )
    body = CHAT | {"stream": True}
    async with (
        running_fake(fake),
        running_gateway([fake.url], limits=config) as gw,
        aiohttp.ClientSession() as s,
    ):
        order: list[str] = []

        async def one(key: str, name: str) -> int:
            async with s.post(gw.url + "/v1/chat/completions", json=body, headers=auth(key)) as r:
                await r.read()
                order.append(name)
                return r.status

        alice = [asyncio.create_task(one(ALICE, "alice")) for _ in range(6)]
        queue = gw.svc.admission
        assert queue is not None
        await wait_for(lambda: queue.waiting >= 4, what="alice's burst queued")
        bob = asyncio.create_task(one(BOB, "bob"))
        statuses = await asyncio.gather(*alice, bob)
    assert set(statuses) == {200}
    # Bob arrived behind four of alice's waiting requests, yet was served within two turns.
    assert order.index("bob") <= 3
    assert queue.waiting == 0
    assert queue.holding == 0


async def test_disconnect_while_queued_leaves_at_once_and_max_wait_is_honoured() -> None:
    fake = FakeBackend(behaviour=stream_chat(3, hold_after=1))
    config = limits(
        {"max_concurrent": 100},
        admission={"enabled": True, "max_in_flight": 1, "max_wait": 0.3},
    )
    body = CHAT | {"stream": True}
    async with (
        running_fake(fake),
        running_gateway([fake.url], limits=config) as gw,
        aiohttp.ClientSession() as s,
    ):
        queue = gw.svc.admission
        assert queue is not None
        held = await s.post(gw.url + "/v1/chat/completions", json=body, headers=auth(ALICE))
        await wait_for(lambda: fake.active() == 1, what="the backend busy")
        waiting = asyncio.create_task(
            s.post(gw.url + "/v1/chat/completions", json=body, headers=auth(BOB))
        )
        await wait_for(lambda: queue.waiting == 1, what="bob queued")
        waiting.cancel()  # bob's client goes away while queued
        await wait_for(lambda: queue.waiting == 0, what="bob left the queue")
        async with s.post(
            gw.url + "/v1/chat/completions", json=body, headers=auth(BOB)
        ) as r:  # nobody frees the backend: bob waits max_wait, then 503
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "queue_timeout"
            assert r.headers["Retry-After"] == "1"
        fake.release.set()
        await held.read()
        await wait_for(lambda: queue.holding == 0, what="tickets released")
        limiter = gw.svc.limiter
        await wait_for(lambda: set(gw.in_flight().values()) == {0}, what="leases released")
    assert len(fake.seen) == 1  # neither of bob's requests reached the backend
    assert limiter.rejections == Counter()


async def test_a_scrape_that_shows_room_wakes_the_queue() -> None:
    """A request queued on the engine's own queue depth runs as soon as a scrape shows room,
    not at max_wait (issue 16.6): health changes are not the only news of capacity."""
    busy = 'vllm:num_requests_waiting{engine="0",model_name="m"} 9.0\n'
    fake = FakeBackend(metrics_text=busy)
    # max_wait is past the test's own timeout: a 200 can only come from the scrape's wake-up
    # (at max_wait the request would be answered 503, queue_timeout).
    config = limits({}, admission={"enabled": True, "max_queue_depth": 5, "max_wait": 3600})
    async with (
        running_fake(fake),
        running_gateway([fake.url], limits=config) as gw,
        aiohttp.ClientSession() as s,
    ):
        queue = gw.svc.admission
        assert queue is not None
        await wait_for(lambda: gw.svc.pool.all()[0].load is not None, what="a first scrape")
        request = asyncio.create_task(
            s.post(gw.url + "/v1/chat/completions", json=CHAT, headers=auth(ALICE))
        )
        await wait_for(lambda: queue.waiting == 1, what="queued on the engine's queue depth")
        fake.metrics_text = busy.replace("9.0", "0.0")
        async with await request as r:
            assert r.status == 200
    assert queue.stats.admitted_after_wait == 1
