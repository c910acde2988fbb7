"""Every model-addressed JSON endpoint of vLLM through the gateway: routed by model, only to
backends that have the endpoint (generation servers and pooling servers may serve one model
name), counted by endpoint, with OpenAI-shaped errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.limits.tokens import reservation
from gateway.request.endpoints import ENDPOINTS
from tests.helpers import gateway_for
from tools.sim import RunningSim, SimConfig

FAST = SimConfig(step_base_ms=1.0)
POOLING = FAST.replace(runner="pooling")
MODEL = "sim-model"


async def post(s: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with s.post(url, json=body) as r:
        return r.status, await r.json()


def requests_by(text: str, **labels: str) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "llm_gateway_requests_total"
        and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def test_each_endpoint_goes_to_a_backend_that_has_it_and_is_learned() -> None:
    gen = RunningSim(FAST)
    pool_sim = RunningSim(POOLING)
    async with gateway_for(gen, pool_sim, policy="round_robin") as (gw, s):
        gen_id, pool_id = gen.url[7:], pool_sim.url[7:]
        for _ in range(4):  # whichever round robin offers first, the answer is right
            status, doc = await post(
                s, gw.url + "/v1/embeddings", {"model": MODEL, "input": ["hi there", "x"]}
            )
            assert status == 200, doc
            assert [d["index"] for d in doc["data"]] == [0, 1]
            assert doc["usage"]["completion_tokens"] == 0
            status, doc = await post(
                s,
                gw.url + "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert status == 200, doc
            assert doc["object"] == "chat.completion"
        state = gw.svc.pool
        chats = 4
        while "chat" not in state.get(pool_id).lacks:  # type: ignore[union-attr]
            assert chats < 12, "the pooling server was never offered a chat request"
            status, doc = await post(
                s,
                gw.url + "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert status == 200, doc
            chats += 1
        assert state.get(gen_id).lacks == frozenset({"embeddings"})  # type: ignore[union-attr]
        assert state.get(pool_id).lacks == frozenset({"chat"})  # type: ignore[union-attr]
        for path, body, check in (
            ("/pooling", {"model": MODEL, "input": "hi"}, lambda d: d["object"] == "list"),
            ("/score", {"model": MODEL, "queries": "a", "documents": ["a", "b"]}, None),
            ("/v1/score", {"model": MODEL, "text_1": "a", "text_2": ["a"]}, None),
            ("/rerank", {"model": MODEL, "query": "a", "documents": ["b", "a"]}, None),
            ("/v1/rerank", {"model": MODEL, "query": "a", "documents": ["b"]}, None),
            ("/v2/rerank", {"model": MODEL, "query": "a", "documents": ["b"], "top_n": 1}, None),
            ("/tokenize", {"model": MODEL, "prompt": "ba be"}, lambda d: d["count"] == 2),
            ("/detokenize", {"model": MODEL, "tokens": [0, 1]}, lambda d: "prompt" in d),
        ):
            status, doc = await post(s, gw.url + path, body)
            assert status == 200, (path, doc)
            assert check is None or check(doc), (path, doc)
        async with s.get(gw.url + "/metrics") as r:
            text = await r.text()
        # Each endpoint counted under its name; pooling ones all answered by the pooling server
        # (once the generation server had said it lacks them).
        assert requests_by(text, endpoint="embeddings", status="200") == 4
        assert requests_by(text, endpoint="embeddings", backend=pool_id) == 4
        assert requests_by(text, endpoint="chat", backend=gen_id) == chats
        for name in ("pooling", "score", "rerank", "tokenize", "detokenize"):
            assert requests_by(text, endpoint=name) >= 1, name
        assert requests_by(text, endpoint="rerank") == 3  # /rerank, /v1/rerank, /v2/rerank


async def test_an_endpoint_no_backend_has_is_a_404_in_openai_shape_without_retrying() -> None:
    gen = RunningSim(FAST)
    async with gateway_for(gen) as (gw, s):
        for _ in range(2):
            status, doc = await post(s, gw.url + "/v1/embeddings", {"model": MODEL, "input": "x"})
            assert status == 404
            err = doc["error"]
            assert err["code"] == "endpoint_not_served"
            assert err["type"] == "invalid_request_error"
            assert "--runner pooling" in err["message"] or "embeddings" in err["message"]
        # The second one was refused from what the gateway knew: no backend was tried.
        async with s.get(gw.url + "/metrics") as r:
            text = await r.text()
        assert requests_by(text, endpoint="embeddings", backend=gen.url[7:]) == 1
        assert requests_by(text, endpoint="embeddings", backend="none") == 1
        assert gw.svc.pool.get(gen.url[7:]).lacks == {"embeddings"}  # type: ignore[union-attr]
        # Its chat still works; a model nobody serves is the gateway's own 404.
        status, _ = await post(
            s,
            gw.url + "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert status == 200
        status, doc = await post(s, gw.url + "/v1/embeddings", {"model": "nope", "input": "x"})
        assert status == 404
        assert doc["error"]["code"] == "model_not_found"


async def test_bad_bodies_on_every_endpoint_are_4xx_in_openai_shape() -> None:
    async with gateway_for(RunningSim(FAST), RunningSim(POOLING)) as (gw, s):
        for path in ("/v1/embeddings", "/pooling", "/score", "/rerank", "/tokenize", "/detokenize"):
            async with s.post(gw.url + path, data=b"{not json") as r:
                assert r.status == 400, path
                assert (await r.json())["error"]["type"] == "invalid_request_error"
            status, doc = await post(s, gw.url + path, {"input": "no model"})
            assert status == 400, path
            assert doc["error"]["param"] == "model"
            # The engine's own validation comes back as it gave it: a 400 in the envelope.
            status, doc = await post(s, gw.url + path, {"model": MODEL})
            assert status == 400, (path, doc)
            assert "error" in doc


def test_endpoints_that_generate_nothing_reserve_no_completion_budget() -> None:
    body = {"model": MODEL, "input": ["x" * 400, "y" * 400]}
    assert reservation(body, default_max_tokens=1024, generates=False) == 200
    assert reservation(body, default_max_tokens=1024) == 200 + 1024
    rerank = {"query": "q" * 40, "documents": ["d" * 40, "e" * 40]}
    assert reservation(rerank, generates=False) == 30
    responses = {"input": [{"role": "user", "content": "z" * 80}], "max_output_tokens": 7}
    assert reservation(responses) == 20 + 7


def test_the_readmes_endpoint_table_names_every_route_the_gateway_serves() -> None:
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    table = readme.split("## Endpoints", 1)[1].split("\n## ", 1)[0]
    routed = [p for e in ENDPOINTS for p in e.paths]
    derendered = [p for p in routed if p.endswith("/derender")]  # written as /v1/*/derender
    missing = [p for p in routed if f"`{p}`" not in table and p not in derendered]
    assert missing == []
    assert "`/v1/*/derender`" in table
