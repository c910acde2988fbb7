"""Adding an API takes one module and one row of the table: a toy API (``toy.py``) routed by a
real gateway as the table's other endpoints are, under its limits, with what it does
differently asked of it (its view of the body, its id upstream), and nothing else to change."""

from __future__ import annotations

import json

import aiohttp

from backends.upstream.mock import MockRequest, MockResponse, MockTransport
from gateway.request.endpoints import ENDPOINTS
from tests.gateway.request.apis.toy import TOY
from tests.helpers import running_gateway, sample
from tests.mock_fleet import Fleet, chunk

BACKENDS = ["http://b1:8000"]


async def test_a_toy_api_is_one_module_and_one_table_row() -> None:
    seen: list[MockRequest] = []

    async def backend(request: MockRequest) -> MockResponse:
        seen.append(request)
        events = [chunk({"choices": [{"index": 0, "text": w}]}) for w in ("a", "b")]

        async def stream() -> object:
            for e in (*events, b"data: [DONE]\n\n"):
                yield e

        return MockResponse(200, stream(), {"Content-Type": "text/event-stream"})  # type: ignore[arg-type]

    fleet = Fleet({"b1:8000": backend})
    limits = {"tiers": {"default": {"tokens_per_minute": 1000}}}
    async with (
        running_gateway(
            BACKENDS, transport=MockTransport(fleet), endpoints=(*ENDPOINTS, TOY), limits=limits
        ) as gw,
        aiohttp.ClientSession() as s,
    ):
        toy = {"model": "m", "input": "hello", "budget": 10, "stream": True, "toy_id": "t42"}
        async with s.post(gw.url + "/v1/toy", json=toy) as r:
            assert r.status == 200, await r.text()
            assert (
                await r.read()
                == b"".join(chunk({"choices": [{"index": 0, "text": w}]}) for w in ("a", "b"))
                + b"data: [DONE]\n\n"
            )
        # as sent, asking for the usage a data stream can carry (as for every such endpoint)
        asked = {**toy, "stream_options": {"include_usage": True}}
        assert [(q.path, json.loads(q.body)) for q in seen] == [("/v1/toy", asked)]
        assert seen[0].headers["X-Request-Id"] == "t42"  # the toy's id upstream
        # the limits read the toy's view: a budget past the minute's tokens is refused
        async with s.post(gw.url + "/v1/toy", json={**toy, "budget": 5000}) as r:
            assert r.status == 429
            assert (await r.json())["error"]["type"] == "tokens"
        assert len(seen) == 1
        # counted under its own name, as every endpoint of the table is
        counted = {"model": "m", "endpoint": "toy"}
        assert (
            sample(gw, "llm_gateway_requests_total", backend="b1:8000", status="200", **counted)
            == 1
        )
        assert (
            sample(gw, "llm_gateway_requests_total", backend="none", status="429", **counted) == 1
        )
        # and bad input answered in the table's error shape, nothing sent
        async with s.post(gw.url + "/v1/toy", data=b"{not json") as r:
            assert r.status == 400
            assert "error" in await r.json()
        assert len(seen) == 1
