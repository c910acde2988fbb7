"""``llm-gateway top`` against a live gateway, and its arithmetic on fixed inputs."""

from __future__ import annotations

import asyncio
import io
from typing import Any

import pytest
from rich.console import Console

from gateway.cli import main
from tests.helpers import FakeBackend, gateway_for, stream_chat
from tests.redis_server import RedisServer
from tools.top import (
    MetricsSample,
    TopClient,
    admin_token,
    bucket_quantile,
    frame,
    render_replicas,
)

TOKEN = "top-secret"


def test_bucket_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.1, 10.0), (0.5, 60.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert bucket_quantile(buckets, 0.1) == pytest.approx(0.1)
    assert bucket_quantile(buckets, 0.5) == pytest.approx(0.1 + 0.4 * 40 / 50)
    assert bucket_quantile(buckets, 0.99) == pytest.approx(0.5 + 0.5 * 39 / 40)
    assert bucket_quantile([(1.0, 0.0), (float("inf"), 0.0)], 0.5) is None
    assert bucket_quantile([(1.0, 0.0), (float("inf"), 4.0)], 0.5) == 1.0


def test_rates_and_quantiles_cover_only_the_last_interval() -> None:
    view = {
        "backends": [
            {"id": "a", "health": "up", "circuit": "closed", "draining": False, "in_flight": 3}
        ]
    }
    prev = MetricsSample(10.0, {"a": 100.0}, {"a": [(0.1, 50.0), (float("inf"), 100.0)]})
    cur = MetricsSample(12.0, {"a": 120.0}, {"a": [(0.1, 50.0), (float("inf"), 120.0)]})
    (row,) = frame(view, cur, prev)
    assert row.rps == 10.0
    # All 20 new requests were slower than 0.1 s: the old fast ones no longer count.
    assert row.ttft_p50 == 0.1
    (first,) = frame(view, cur, None)
    assert first.rps is None


async def test_top_renders_a_frame_from_a_live_gateway() -> None:
    fake = FakeBackend(behaviour=stream_chat(3))
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with gateway_for(fake, admin={"token": TOKEN}) as (gw, s):
        assert gw.admin_url is not None
        client = TopClient(s, gw.admin_url, TOKEN)
        await client.next_frame()
        for _ in range(4):
            async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                await r.read()
        table = await client.next_frame()
    out = io.StringIO()
    Console(file=out, width=160).print(table)
    text = out.getvalue()
    assert "policy: least_load" in text
    assert fake.url[7:] in text
    assert "up" in text
    assert "closed" in text
    assert " ms" in text  # a TTFT quantile was computed from the requests in the interval


def test_top_without_a_token_says_how_to_give_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GATEWAY_ADMIN__TOKEN", raising=False)
    monkeypatch.delenv("LLM_GATEWAY_ADMIN_TOKEN", raising=False)
    assert main(["top", "--admin", "http://127.0.0.1:9"]) == 2
    said = capsys.readouterr().out
    assert "--token" in said
    assert "GATEWAY_ADMIN__TOKEN" in said


async def top_once(admin_url: str) -> int:
    """``llm-gateway top --once`` as a shell runs it (its own event loop, in a thread)."""
    return await asyncio.to_thread(main, ["top", "--admin", admin_url, "--once", "--interval", "0"])


async def test_top_reads_the_token_from_the_variable_the_gateway_reads(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """GATEWAY_ADMIN__TOKEN sets the gateway's admin.token; the same variable serves top."""
    monkeypatch.delenv("LLM_GATEWAY_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("GATEWAY_ADMIN__TOKEN", TOKEN)
    async with gateway_for(FakeBackend(), admin={"token": TOKEN}) as (gw, _):
        assert gw.admin_url is not None
        assert await top_once(gw.admin_url) == 0
    said = capsys.readouterr()
    assert "policy: least_load" in said.out
    assert said.err == ""


async def test_top_still_reads_its_old_variable_and_says_it_is_deprecated(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GATEWAY_ADMIN__TOKEN", raising=False)
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_TOKEN", TOKEN)
    async with gateway_for(FakeBackend(), admin={"token": TOKEN}) as (gw, _):
        assert gw.admin_url is not None
        assert await top_once(gw.admin_url) == 0
    said = capsys.readouterr()
    assert "policy: least_load" in said.out
    assert "LLM_GATEWAY_ADMIN_TOKEN is deprecated: set GATEWAY_ADMIN__TOKEN" in said.err


def test_the_token_flag_wins_then_the_gateways_variable_then_the_old_one() -> None:
    both = {"GATEWAY_ADMIN__TOKEN": "new", "LLM_GATEWAY_ADMIN_TOKEN": "old"}
    assert admin_token("flag", both) == ("flag", None)
    assert admin_token(None, both) == ("new", None)
    token, warning = admin_token(None, {"LLM_GATEWAY_ADMIN_TOKEN": "old"})
    assert token == "old"
    assert warning is not None
    assert admin_token(None, {}) == (None, None)


def test_top_shows_the_fleets_replicas_and_who_lags() -> None:
    report = {"version": "0.1.0", "address": "10.0.0.1:8080", "uptime_s": 62.0}
    doc = {
        "fleet": "prod",
        "self": "r0",
        "summary": {"replicas": 2, "head": "17-0", "lagging": ["r1"]},
        "replicas": [
            {**report, "id": "r0", "in_flight": {"a": 2, "b": 1}, "applied": "17-0"},
            {**report, "id": "r1", "in_flight": {"a": 4}, "applied": "12-0"},
        ],
    }
    text = rendered(doc)
    assert "fleet prod: 2 replicas, log at 17-0, behind: r1" in text
    assert "r0 *" in text  # the replica top asks
    assert "12-0" in text
    assert render_replicas({"fleet": None, "replicas": []}) is None  # a gateway alone


def rendered(doc: dict[str, Any]) -> str:
    """``render_replicas``' table as a terminal 160 columns wide shows it."""
    table = render_replicas(doc)
    assert table is not None
    out = io.StringIO()
    Console(file=out, width=160).print(table)
    return out.getvalue()


def figures(requests: int, **kw: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "requests": requests,
        "errors": 0,
        "ttft": [],
        "rejections": {},
        "canary": {},
        "decisions": {},
        "ttft_p50_s": None,
        "ttft_p99_s": None,
    }
    return doc | kw


def test_top_shows_each_replicas_requests_and_the_fleets_figures_summed() -> None:
    report = {"version": "0.2.0", "address": "10.0.0.1:8080", "uptime_s": 9.0, "applied": "3-0"}
    doc = {
        "fleet": "prod",
        "self": "r1",
        "summary": {
            "replicas": 2,
            "head": "3-0",
            "lagging": [],
            "disagree": {"gpu-b": {"r0": "up", "r1": "down"}},
            "figures": figures(
                1234,
                errors=7,
                ttft_p50_s=0.042,
                ttft_p99_s=0.3,
                decisions={"gpu-a": 600, "gpu-b": 200},
                canary={"chat": {"stable": 90, "canary": 10}},
                rejections={"web-app": 3, "(other)": 12},
            ),
        },
        "replicas": [
            {**report, "id": "r0", "in_flight": {}, "figures": figures(1000)},
            {**report, "id": "r1", "in_flight": {"gpu-a": 1}, "figures": figures(234)},
            {**report, "id": "r2-old", "in_flight": {}},  # a replica of before the figures
        ],
    }
    text = rendered(doc)
    assert "health seen differently: gpu-b (r0 up, r1 down)" in text
    assert "fleet: 1234 requests · 7 errors (5xx) · TTFT p50 42 ms p99 300 ms" in text
    assert "routed: gpu-a 600 (75%) · gpu-b 200 (25%)" in text
    assert "canary chat: stable 90 (90%) · canary 10 (10%)" in text
    assert "rejected: (other) 12 · web-app 3" in text
    for rid, requests in (("r0", "1000"), ("r1 *", "234"), ("r2-old", "-")):
        (line,) = [ln for ln in text.splitlines() if f" {rid} " in ln]
        assert f" {requests} " in line


def test_top_shows_the_fleets_change_log_and_each_replicas() -> None:
    """The log as the replica asked sees it in the title (lost: being healed), each replica's
    own word or the fleet's (another epoch), and the losses this replica found."""
    report = {"version": "0.3.0", "address": "10.0.0.1:8080", "uptime_s": 5.0, "in_flight": {}}
    doc = {
        "fleet": "prod",
        "self": "r0",
        "log": "lost",
        "losses": 2,
        "summary": {
            "replicas": 4,
            "head": "9-0",
            "lagging": [],
            "log_problems": {"r0": "lost", "r1": "unreachable", "r2": "other epoch"},
        },
        "replicas": [
            {**report, "id": "r0", "applied": "9-0", "log": "lost"},
            {**report, "id": "r1", "applied": "9-0", "log": "unreachable"},
            {**report, "id": "r2", "applied": "9-0", "log": "ok"},  # ok by its word alone
            {**report, "id": "r3", "applied": "9-0", "log": "ok"},
        ],
    }
    text = rendered(doc)
    assert "fleet prod: 4 replicas, log at 9-0, behind: none, change log lost, healing" in text
    for rid, state in (("r0 *", "lost, healing"), ("r1", "unreachable"), ("r2", "other epoch")):
        (line,) = [ln for ln in text.splitlines() if f" {rid} " in ln]
        assert line.rstrip(" │").endswith(state), line
    (r3,) = [ln for ln in text.splitlines() if " r3 " in ln]
    assert r3.rstrip(" │").endswith(" ok")
    assert "change log found lost 2 times since this replica started" in text
    assert "STALE" not in text
    whole = rendered(
        {**doc, "log": "ok", "losses": 0, "summary": {**doc["summary"], "log_problems": {}}}
    )
    assert "change log ok" in whole
    assert "found lost" not in whole
    unreachable = rendered({**doc, "log": "unreachable"})
    assert "behind: none, change log unreachable" in unreachable


def test_top_marks_replicas_answered_from_the_last_state_known_stale() -> None:
    report = {"version": "0.3.0", "address": "10.0.0.1:8080", "uptime_s": 5.0, "in_flight": {}}
    doc = {
        "fleet": "prod",
        "self": "r0",
        "log": "unreachable",
        "summary": {"replicas": 1, "head": "9-0", "lagging": []},
        "replicas": [{**report, "id": "r0", "applied": "9-0", "log": "unreachable"}],
        "stale": {"age_s": 12.4, "why": "TimeoutError"},
    }
    text = rendered(doc)
    assert "STALE: Redis does not answer (TimeoutError); the replicas as of 12 s ago" in text
    never = rendered({**doc, "stale": {"age_s": None, "why": "TimeoutError"}})
    assert "nothing read from it since this replica started: this replica alone" in never


def frame_text(table: object) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(table)
    return out.getvalue()


async def test_top_against_a_fleet_whose_redis_pauses_says_so_then_goes_live_again(
    own_redis: RedisServer, redis_prefix: str
) -> None:
    """A replica of a fleet on a Redis of the test's own: its log ok; Redis paused (SIGSTOP),
    the replicas are shown stale, the log unreachable once the replica finds out; live again
    once Redis answers."""
    redis = {"url": own_redis.url, "key_prefix": redis_prefix, "timeout": 0.5}
    settings = {
        "admin": {"token": TOKEN},
        "limits": {"store": "redis", "redis": redis},
        "fleet": {"log": "redis", "view_timeout": 0.3, "replica": "top-r0"},
    }
    async with gateway_for(FakeBackend(), **settings) as (gw, s):
        assert gw.admin_url is not None
        client = TopClient(s, gw.admin_url, TOKEN)
        text = frame_text(await client.next_frame())
        assert "replicas, log at" in text
        assert "change log ok" in text
        assert "STALE" not in text
        own_redis.pause()
        try:
            text = frame_text(await client.next_frame())
            assert "STALE: Redis does not answer" in text
            deadline = asyncio.get_running_loop().time() + 30
            while "change log unreachable" not in text:
                assert asyncio.get_running_loop().time() < deadline, text
                await asyncio.sleep(0.2)  # sleep-ok: polling the gateway with a deadline
                text = frame_text(await client.next_frame())
            (row,) = [ln for ln in text.splitlines() if " top-r0 * " in ln]
            assert row.rstrip(" │").endswith("unreachable")
        finally:
            own_redis.resume()
        deadline = asyncio.get_running_loop().time() + 30
        while "STALE" in text or "change log ok" not in text:
            assert asyncio.get_running_loop().time() < deadline, text
            await asyncio.sleep(0.2)  # sleep-ok: polling the gateway with a deadline
            text = frame_text(await client.next_frame())
