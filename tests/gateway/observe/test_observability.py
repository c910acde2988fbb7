"""Metrics, traces and logs tell what happened to each request, and never leak a secret."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import LogCapture, capture_logs

from gateway.observe.logs import redact_secrets
from gateway.observe.metrics import QUEUE_DEPTH_METRIC
from policies import NO_NEEDS
from tests.helpers import (
    FakeBackend,
    gateway_for,
    hang_before_headers,
    kill,
    running_fake,
    running_gateway,
    stream_chat,
    wait_for,
)
from tools.sim import FAST, Faults, RunningSim

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def scrape(s: aiohttp.ClientSession, url: str) -> dict[tuple[str, tuple[Any, ...]], float]:
    async with s.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict[tuple[str, tuple[Any, ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_request_counters_and_histograms_move() -> None:
    fake = FakeBackend(behaviour=stream_chat(5))
    async with gateway_for(fake) as (gw, s):
        bid = fake.url[7:]
        for _ in range(3):
            async with s.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
                await r.read()
        async with s.post(gw.url + "/v1/chat/completions", json=CHAT | {"model": "x"}) as r:
            assert r.status == 404
        m = await scrape(s, gw.url)
    ok = {"model": "m", "backend": bid, "status": "200", "endpoint": "chat"}
    assert value(m, "llm_gateway_requests_total", **ok) == 3
    # A model the fleet does not serve is counted under "other": clients cannot grow labels.
    unknown = {"model": "other", "backend": "none", "status": "404", "endpoint": "chat"}
    assert value(m, "llm_gateway_requests_total", **unknown) == 1
    assert value(m, "llm_gateway_time_to_first_token_seconds_count", model="m", backend=bid) == 3
    assert value(m, "llm_gateway_inter_token_latency_seconds_count", model="m", backend=bid) == 3
    assert value(m, "llm_gateway_backend_up", backend=bid) == 1
    assert value(m, "llm_gateway_backend_circuit", backend=bid, state="closed") == 1
    assert value(m, "llm_gateway_backend_in_flight", backend=bid) == 0


async def test_client_disconnect_raises_the_abort_counter() -> None:
    fake = FakeBackend(behaviour=stream_chat(10, hold_after=2))
    async with gateway_for(fake) as (gw, s):
        bid = fake.url[7:]
        before = await scrape(s, gw.url)
        r = await s.post(gw.url + "/v1/chat/completions", json=CHAT)
        await wait_for(lambda: fake.active() == 1, what="stream running")
        r.close()
        await wait_for(lambda: fake.active() == 0, what="upstream closed")
        await wait_for(lambda: set(gw.in_flight().values()) == {0}, what="released")
        after = await scrape(s, gw.url)
    name = "llm_gateway_upstream_aborts_total"
    assert value(before, name, backend=bid, reason="client_disconnect") == 0
    assert value(after, name, backend=bid, reason="client_disconnect") == 1


async def test_slow_backend_score_rises_and_queue_gauge_returns_to_zero() -> None:
    config = FAST.replace(max_num_seqs=1)
    slow = RunningSim(config, faults=Faults(slowdown=30))
    fast = RunningSim(config)
    async with gateway_for(slow, fast, policy="round_robin") as (gw, s):
        slow_id, fast_id = slow.url[7:], fast.url[7:]
        body = {"model": "sim-model", "prompt": "hello", "max_tokens": 20, "stream": True}

        async def one() -> None:
            async with s.post(gw.url + "/v1/completions", json=body) as r:
                await r.read()

        load = [asyncio.create_task(one()) for _ in range(8)]
        # Summed over the run: the slow backend's score stays high while the fast one drains.
        total: dict[str, float] = {slow_id: 0.0, fast_id: 0.0, "queue": 0.0}
        while not all(t.done() for t in load):
            m = await scrape(s, gw.url)
            for bid in (slow_id, fast_id):
                total[bid] += value(m, "llm_gateway_backend_score", backend=bid)
            total["queue"] = max(total["queue"], value(m, QUEUE_DEPTH_METRIC))
            await asyncio.sleep(0.02)  # sleep-ok: sampling interval while load runs
        await asyncio.gather(*load)

        async def drained() -> bool:
            m = await scrape(s, gw.url)
            return value(m, QUEUE_DEPTH_METRIC) == 0

        deadline = asyncio.get_running_loop().time() + 5
        while not await drained():
            assert asyncio.get_running_loop().time() < deadline, "queue gauge stuck"
            await asyncio.sleep(0.05)  # sleep-ok: waiting for the next backend scrape
    assert total[slow_id] > 2 * total[fast_id]
    assert total["queue"] > 0


async def test_span_tree_and_trace_id_reach_the_backend() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    fake = FakeBackend(behaviour=stream_chat(3))
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    async with (
        gateway_for(fake, tracer_provider=provider) as (gw, s),
        s.post(
            gw.url + "/v1/chat/completions",
            json=CHAT,
            headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"},
        ) as r,
    ):
        await r.read()
    spans = {sp.name: sp for sp in exporter.get_finished_spans()}
    server = spans["POST /v1/chat/completions"]
    attempt = spans["upstream attempt"]
    assert format(server.context.trace_id, "032x") == trace_id
    assert server.parent is not None
    assert format(server.parent.span_id, "016x") == "b7ad6b7169203331"
    assert attempt.parent is not None
    assert attempt.parent.span_id == server.context.span_id
    assert attempt.attributes is not None
    assert attempt.attributes["llm_gateway.backend"] == fake.url[7:]
    assert attempt.attributes["http.response.status_code"] == 200
    assert server.attributes is not None
    assert server.attributes["gen_ai.request.model"] == "m"
    assert server.attributes["llm_gateway.time_to_first_token_s"] > 0
    sent = fake.seen[0].headers["traceparent"]
    assert sent.split("-")[1] == trace_id
    assert sent.split("-")[2] == format(attempt.context.span_id, "016x")


async def test_one_log_event_per_request_with_routing_decision_and_no_secrets() -> None:
    a, b = FakeBackend(behaviour=stream_chat(3)), FakeBackend(behaviour=stream_chat(3))
    async with running_fake(a), running_fake(b):
        backends: Any = [{"url": a.url, "api_key": "sk-backend-a"}, b.url]
        async with (
            running_gateway(backends, log_level="info") as gw,
            aiohttp.ClientSession() as s,
        ):
            with capture_logs() as logs:
                async with s.post(
                    gw.url + "/v1/chat/completions",
                    json=CHAT,
                    headers={"Authorization": "Bearer sk-client-secret", "X-Request-Id": "r-1"},
                ) as r:
                    await r.read()
                # The event is logged as the handler ends, just after the last byte is sent.
                await wait_for(lambda: any(e["event"] == "request" for e in logs), what="log")
    events = [e for e in logs if e["event"] == "request"]
    assert len(events) == 1
    e = events[0]
    assert e["request_id"] == "r-1"
    assert e["model"] == "m"
    assert e["status"] == 200
    assert e["ending"] == "complete"
    assert e["backend"] in (a.url[7:], b.url[7:])
    assert e["ttft_ms"] > 0
    assert e["duration_ms"] >= e["ttft_ms"]
    assert set(e["candidates"]) == {a.url[7:], b.url[7:]}
    dumped = json.dumps(logs, default=str)
    assert "sk-client-secret" not in dumped
    assert "sk-backend-a" not in dumped


def test_redaction_processor_hides_credentials_whatever_the_caller_passes() -> None:
    event = {"event": "x", "Authorization": "Bearer sk-1", "api_key": "k", "ok": 1}
    out = redact_secrets(None, "info", event)
    assert out == {"event": "x", "Authorization": "[redacted]", "api_key": "[redacted]", "ok": 1}


async def test_an_abandoned_stream_is_logged_and_counted_with_its_ttft_and_events() -> None:
    """A stream the client leaves mid-way still has its first-token time and event count
    (issue 16.5): the TTFT histogram describes every stream that got a token, not only those
    that ran to the end."""
    fake = FakeBackend(behaviour=stream_chat(10, hold_after=3))
    async with gateway_for(fake, log_level="info") as (gw, s):
        bid = fake.url[7:]
        with capture_logs() as logs:
            r = await s.post(gw.url + "/v1/chat/completions", json=CHAT)
            seen = b""
            while seen.count(b'"content":"t') < 3:
                seen += await r.content.readany()
            r.close()
            await wait_for(lambda: any(e["event"] == "request" for e in logs), what="log")
        m = await scrape(s, gw.url)
    (event,) = [e for e in logs if e["event"] == "request"]
    assert event["ending"] == "client_disconnect"
    assert event["ttft_ms"] is not None
    assert event["ttft_ms"] > 0
    assert event["events"] >= 4  # the role chunk and three tokens
    assert value(m, "llm_gateway_time_to_first_token_seconds_count", model="m", backend=bid) == 1


async def test_each_ending_is_told_truthfully_an_internal_failure_is_not_a_client_that_left() -> (
    None
):
    """Issue 16.9: a bug is logged as internal_error (500), a client that leaves while its
    request waits for the backend as client_disconnect, a refusal by its error's name."""

    class Broken:
        name = "broken"
        needs = NO_NEEDS
        weights = None

        def choose(self, facts: object, candidates: object) -> None:
            raise RuntimeError("a policy bug")

        def on_result(self, facts: object, decision: object, outcome: object) -> None:
            pass

    fake = FakeBackend(behaviour=hang_before_headers)
    async with gateway_for(fake, log_level="info") as (gw, s):
        router = gw.svc.router
        with capture_logs() as logs:
            # Left while the backend had not answered yet.
            left = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", json=CHAT))
            await wait_for(lambda: fake.active() == 1, what="request upstream")
            left.cancel()  # closes the connection: the client is gone
            await wait_for(lambda: len(_requests(logs)) == 1, what="first log")
            async with s.post(gw.url + "/v1/chat/completions", json=CHAT | {"model": "x"}) as r:
                assert r.status == 404
            good, router.policy = router.policy, Broken()  # type: ignore[assignment]
            async with s.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 500
                assert (await r.json())["error"]["type"] == "internal_error"
            router.policy = good
            await wait_for(lambda: len(_requests(logs)) == 3, what="three logs")
    endings = [(e["ending"], e["status"]) for e in _requests(logs)]
    assert endings == [
        ("client_disconnect", 0),
        ("ModelNotFound", 404),
        ("internal_error", 500),
    ]


def _requests(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "request"]


async def test_an_abort_while_the_backend_has_not_answered_yet_is_counted() -> None:
    """Issue 16.12: every non-streaming request (and a stream still queued in the engine)
    waits for the response head; a client leaving then was never counted as an abort."""
    fake = FakeBackend(behaviour=hang_before_headers)
    async with gateway_for(fake) as (gw, s):
        bid = fake.url[7:]
        for body in (CHAT | {"stream": False}, CHAT):
            left = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", json=body))
            await wait_for(lambda: fake.active() == 1, what="waiting for the head")
            left.cancel()
            await wait_for(lambda: fake.active() == 0, what="upstream closed")
        await wait_for(lambda: set(gw.in_flight().values()) == {0}, what="released")
        m = await scrape(s, gw.url)
    name = "llm_gateway_upstream_aborts_total"
    assert value(m, name, backend=bid, reason="client_disconnect") == 2
    assert [seen.ending for seen in fake.seen] == ["cancelled", "cancelled"]


async def test_every_log_line_of_a_request_carries_its_id_bound_once() -> None:
    """The request id is bound with structlog's contextvars, not passed by hand: a retry's log
    line has it, and it does not leak into the next request on the same connection."""

    async def full(request: web.Request, fake: FakeBackend, seen: Any) -> web.StreamResponse:
        return web.json_response({"error": {"message": "full"}}, status=503)

    busy, ok = FakeBackend(behaviour=full), FakeBackend()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, LogCapture()],
        cache_logger_on_first_use=False,
    )
    capture = structlog.get_config()["processors"][-1]
    try:
        async with gateway_for(busy, ok, policy="round_robin") as (gw, s):
            for rid in ("first-id", "second-id"):
                headers = {"X-Request-Id": rid}
                async with s.post(
                    gw.url + "/v1/completions", json={"model": "m"}, headers=headers
                ) as r:
                    assert r.status == 200
    finally:
        structlog.reset_defaults()
    retries = [e for e in capture.entries if e["event"] == "upstream_retry"]
    # Each request met the busy backend first (round robin) and its retry line has its own id.
    assert [e["request_id"] for e in retries] == ["first-id", "second-id"]
    assert "request_id" not in structlog.contextvars.get_contextvars()


_LOG_WRITER = """
import sys
from gateway.observe.logs import configure_logging
import structlog
configure_logging("info", "json")
log = structlog.get_logger("t")
for i in range(int(sys.argv[1])):
    log.info("line", writer=sys.argv[2], i=i, pad="x" * 200)
"""


async def test_processes_sharing_stderr_unbuffered_never_splice_each_others_lines() -> None:
    """The workers of ``serve --workers`` share one stderr; with PYTHONUNBUFFERED (usual in
    containers) each log line must still reach it in one write, or lines are spliced into
    JSON no collector can parse (found as a worker's lost ``gateway_listening``)."""
    read_fd, write_fd = os.pipe()
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    lines = 3000
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", _LOG_WRITER, str(lines), name, stderr=write_fd, env=env
        )
        for name in ("a", "b", "c")
    ]
    os.close(write_fd)
    loop = asyncio.get_running_loop()
    with os.fdopen(read_fd, "rb") as pipe:
        raw = await loop.run_in_executor(None, pipe.read)
    for p in procs:
        assert await p.wait() == 0
    events = [json.loads(line) for line in raw.splitlines()]  # every line whole JSON
    for name in ("a", "b", "c"):
        assert [e["i"] for e in events if e["writer"] == name] == list(range(lines))


async def test_routable_backends_counts_those_a_request_could_reach() -> None:
    """The gauge the "no routable backend" alert reads: a drained backend and a dead one
    leave it, and it reaches 0 when none is left."""
    a, b = FakeBackend(), FakeBackend()
    async with gateway_for(a, b) as (gw, s):

        async def routable() -> float:
            return value(await scrape(s, gw.url), "llm_gateway_routable_backends")

        assert await routable() == 2
        gw.svc.pool.set_draining(a.url[7:], True)
        assert await routable() == 1
        await kill(b)
        await wait_for(lambda: not gw.svc.pool.ready(), what="the dead backend ejected")
        assert await routable() == 0
