"""The load driver against small real servers: timings, token counts, error kinds."""

from __future__ import annotations

from aiohttp import web

from loadtest.arrivals import ClosedLoop, LoadShape, OpenLoop
from loadtest.client import ClientOptions, run_load
from loadtest.stats import summarize
from loadtest.workload import LengthDist, Workload
from tests.helpers import bound_socket, serve_app
from tools.fake_vllm import create_app

W = Workload(model="tiny", prompt=LengthDist.fixed(4), output=LengthDist.fixed(5))


async def test_streams_are_timed_and_counted() -> None:
    async with serve_app(create_app(ttft_ms=5, itl_ms=2)) as url:
        result = await run_load(url, W, LoadShape(ClosedLoop(3), requests=9))
    assert len(result.records) == 9
    for r in result.records:
        assert r.ok, r.error
        assert r.tokens_out == 5
        assert len(r.itls) == 4
        assert r.ttft is not None
        assert r.e2e is not None
        assert r.e2e >= r.ttft >= 0.005
    assert result.loop_lag.n >= 0


async def test_non_streaming_and_completions() -> None:
    w = Workload(model="tiny", endpoint="completions", stream=False, output=LengthDist.fixed(3))
    async with serve_app(create_app(ttft_ms=1, itl_ms=1)) as url:
        result = await run_load(url, w, LoadShape(OpenLoop(rate=200.0), requests=4))
    assert [r.tokens_out for r in result.records] == [3] * 4
    assert all(r.ttft == r.e2e for r in result.records)


async def test_multi_turn_sessions_wait_for_their_previous_turn() -> None:
    w = Workload(model="tiny", turns=3, interleave=2, output=LengthDist.fixed(2))
    async with serve_app(create_app(ttft_ms=1, itl_ms=1)) as url:
        result = await run_load(url, w, LoadShape(ClosedLoop(6), requests=6))
    assert len(result.records) == 6
    assert all(r.ok for r in result.records)


async def test_error_kinds() -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["max_tokens"] == 1:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
        return resp  # no [DONE]

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    w = Workload(model="m", output=LengthDist.uniform(1, 2), seed=3)
    async with serve_app(app) as url:
        result = await run_load(url, w, LoadShape(ClosedLoop(2), requests=12))
    kinds = {r.error for r in result.records}
    assert kinds == {"http_503", "incomplete"}
    assert summarize(result.records).errors["http_503"] > 0

    sock = bound_socket()  # bound, never listening: connections are refused
    port = sock.getsockname()[1]
    try:
        result = await run_load(
            f"http://127.0.0.1:{port}",
            W,
            LoadShape(ClosedLoop(1), requests=1),
            ClientOptions(request_timeout=5),
        )
    finally:
        sock.close()
    assert [r.error for r in result.records] == ["connect"]


async def test_warmup_requests_are_marked_and_left_out() -> None:
    async with serve_app(create_app(ttft_ms=1, itl_ms=1)) as url:
        result = await run_load(url, W, LoadShape(OpenLoop(rate=50.0), duration=0.3, warmup=0.2))
    warm = [r for r in result.records if r.warmup]
    assert warm
    assert all(r.start < 0.2 for r in warm)
    assert summarize(result.records).requests == len(result.records) - len(warm)


async def test_several_urls_share_the_requests() -> None:
    hits: list[str] = []

    def app(name: str) -> web.Application:
        inner = create_app(ttft_ms=0, itl_ms=0)

        @web.middleware
        async def count(request: web.Request, handler: web.Handler) -> web.StreamResponse:
            hits.append(name)
            return await handler(request)

        inner.middlewares.append(count)
        return inner

    async with serve_app(app("a")) as a, serve_app(app("b")) as b:
        await run_load([a, b], W, LoadShape(ClosedLoop(1), requests=6))
    assert sorted(hits) == ["a"] * 3 + ["b"] * 3
