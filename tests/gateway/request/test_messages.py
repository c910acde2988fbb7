"""Anthropic's Messages API through the gateway, on simulators, with the official ``anthropic``
client unchanged but for its base URL: streamed and not, ``count_tokens``, a tool's round trip,
keys from ``x-api-key``, limits settled from Anthropic's usage, failover before the first
byte, the engine stopped when the client leaves, metrics by endpoint, and every error in
Anthropic's shape (the SDK's own typed exceptions)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anthropic
import pytest

from gateway.limits.keys import hash_key
from tests.anthropic_stream import read_stream
from tests.helpers import RunningGateway, running_gateway, wait_for
from tools.sim import FAST, Faults, RunningSim, running_sim

MODEL = FAST.model_name
KEY = "sk-ant-gateway-test"
USER = [{"role": "user", "content": "Tell me a story about a gateway."}]


@asynccontextmanager
async def fleet(
    n: int = 2, faults: Faults | None = None, **overrides: Any
) -> AsyncIterator[tuple[RunningGateway, list[RunningSim]]]:
    async with running_sim(FAST, faults) as a, running_sim(FAST) as b:
        sims = [a, b][:n]
        async with running_gateway([s.url for s in sims], **overrides) as gw:
            yield gw, sims


def client(gw: RunningGateway, key: str = KEY) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=30)


def answered(gw: RunningGateway, endpoint: str) -> float:
    """Requests to ``endpoint`` answered 200, over every backend."""
    return sum(
        s.value
        for family in gw.svc.metrics.registry.collect()
        for s in family.samples
        if s.name == "llm_gateway_requests_total"
        and s.labels["endpoint"] == endpoint
        and s.labels["status"] == "200"
    )


def error_type(exc: anthropic.APIStatusError) -> str:
    """The ``error.type`` of an error answer in Anthropic's shape (fails on another shape)."""
    body = exc.body
    assert isinstance(body, dict), body
    assert body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    return str(body["error"]["type"])


def keyed(**tier: Any) -> dict[str, Any]:
    return {
        "auth": True,
        "tiers": {"default": tier},
        "keys": [{"name": "tester", "hash": hash_key(KEY)}],
    }


async def test_a_message_and_a_stream_through_the_sdk() -> None:
    async with fleet() as (gw, _), client(gw) as c:
        message = await c.messages.create(
            model=MODEL, max_tokens=8, messages=USER, system="Be brief."
        )
        assert message.type == "message"
        assert message.role == "assistant"
        assert message.stop_reason == "max_tokens"
        assert message.usage.output_tokens == 8
        assert message.content[0].type == "text"
        assert len(message.content[0].text.split()) == 8
        async with c.messages.stream(model=MODEL, max_tokens=6, messages=USER) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert len(text.split()) == 6
        assert final.usage.output_tokens == 6
        counted = await c.messages.count_tokens(model=MODEL, messages=USER)
        assert final.usage.input_tokens == counted.input_tokens
        with_system = await c.messages.count_tokens(model=MODEL, messages=USER, system="Be brief.")
        assert message.usage.input_tokens == with_system.input_tokens
        assert answered(gw, "messages") == 2
        assert answered(gw, "count_tokens") == 2


async def test_the_raw_stream_is_valid_under_anthropics_format() -> None:
    body = {"model": MODEL, "max_tokens": 7, "stream": True, "messages": USER}
    async with fleet() as (gw, _), aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/messages", json=body) as r:
            assert r.status == 200
            assert r.content_type == "text/event-stream"
            raw = await r.read()
    stream = read_stream(raw)
    assert stream.error is None
    assert len(stream.text.split()) == 7
    assert stream.usage["output_tokens"] == 7
    assert stream.stop_reason == "max_tokens"


async def test_a_tool_round_trip() -> None:
    tool = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
    async with fleet() as (gw, _), client(gw) as c:
        first = await c.messages.create(
            model=MODEL,
            max_tokens=30,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[tool],
            tool_choice={"type": "tool", "name": "get_weather"},
        )
        assert first.stop_reason == "tool_use"
        use = next(b for b in first.content if b.type == "tool_use")
        assert use.name == "get_weather"
        assert isinstance(use.input, dict)
        second = await c.messages.create(
            model=MODEL,
            max_tokens=5,
            tools=[tool],
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
                },
            ],
        )
        assert second.content[0].type == "text"
        assert second.usage.output_tokens == 5


async def test_errors_are_the_sdks_typed_errors() -> None:
    async with fleet(limits=keyed(requests_per_minute=2)) as (gw, _):
        async with client(gw, "sk-wrong") as c:
            with pytest.raises(anthropic.AuthenticationError) as auth:
                await c.messages.create(model=MODEL, max_tokens=2, messages=USER)
            assert error_type(auth.value) == "authentication_error"
        async with client(gw) as c:  # the key in x-api-key, as the SDK sends it
            with pytest.raises(anthropic.NotFoundError) as missing:
                await c.messages.create(model="no-such-model", max_tokens=2, messages=USER)
            assert "no-such-model" in missing.value.message
            assert error_type(missing.value) == "not_found_error"
            await c.messages.create(model=MODEL, max_tokens=2, messages=USER)
            with pytest.raises(anthropic.RateLimitError) as limited:
                await c.messages.create(model=MODEL, max_tokens=2, messages=USER)
            assert int(limited.value.response.headers["retry-after"]) >= 1
            assert error_type(limited.value) == "rate_limit_error"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (json.dumps({"max_tokens": 3, "messages": USER}).encode(), 400),  # no model
    ],
)
async def test_a_malformed_body_is_a_400_in_anthropics_shape(body: bytes, status: int) -> None:
    async with fleet(n=1) as (gw, sims), aiohttp.ClientSession() as s:
        async with s.post(
            gw.url + "/v1/messages", data=body, headers={"content-type": "application/json"}
        ) as r:
            assert r.status == status
            doc = await r.json()
        assert doc["type"] == "error"
        assert doc["error"]["type"] == "invalid_request_error"
        assert set(doc["error"]) == {"type", "message"}
        assert sims[0].engine.stats.prompt_tokens == 0  # nothing reached a backend
        async with s.get(gw.url + "/v1/messages/nothing") as r:
            assert r.status in (404, 405)
            assert (await r.json())["type"] == "error"
        async with s.post(gw.url + "/v1/chat/completions", data=body) as r:
            assert "type" not in await r.json()  # OpenAI's shape elsewhere


async def test_a_refusing_backend_is_passed_over_before_the_first_byte() -> None:
    # Round robin, so the refusing backend is some request's first choice (least_load breaks
    # the tie of two idle backends at random: 4 requests could all miss it, 1 in 16).
    async with (
        fleet(faults=Faults(error_rate=1.0, error_status=503), policy="round_robin") as (gw, sims),
        client(gw) as c,
    ):
        for _ in range(4):
            m = await c.messages.create(model=MODEL, max_tokens=3, messages=USER)
            assert m.usage.output_tokens == 3
        assert sims[0].state.injected_errors >= 1  # it was tried, and refused
        assert sims[1].engine.stats.generation_tokens == 12


async def test_a_client_that_leaves_stops_the_generation() -> None:
    slow = FAST.replace(step_base_ms=20.0)
    body = {"model": MODEL, "max_tokens": 500, "stream": True, "messages": USER}
    async with running_sim(slow) as sim, running_gateway([sim.url]) as gw:
        async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/messages", json=body) as r:
            async for _ in r.content.iter_any():
                break  # the first bytes: then the client goes away
        await wait_for(lambda: sum(sim.engine.stats.aborted.values()) == 1, what="an abort")
        await wait_for(lambda: set(gw.in_flight().values()) == {0}, what="no lease left")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_budget_is_charged_what_anthropics_usage_says(stream: bool) -> None:
    # The reservation (the prompt's estimate plus max_tokens, 400) is settled to the answer's
    # usage: input and output tokens, whether it came in the body or in message_delta.
    async with fleet(limits=keyed(tokens_per_day=100_000)) as (gw, _), client(gw) as c:
        if stream:
            async with c.messages.stream(model=MODEL, max_tokens=9, messages=USER) as s:
                m = await s.get_final_message()
        else:
            m = await c.messages.create(model=MODEL, max_tokens=9, messages=USER)
        usage = await gw.svc.limiter.usage("tester", days=1)
    assert m.usage.output_tokens == 9
    assert usage["days"][0]["tokens"] == m.usage.input_tokens + 9


async def test_a_body_vllm_refuses_is_answered_in_anthropics_shape() -> None:
    # vLLM checks a Messages body before its route runs and answers that in OpenAI's shape
    # (the simulator as vLLM); the gateway turns it into Anthropic's, the status kept.
    async with fleet(n=1) as (gw, _), client(gw) as c:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await c.messages.create(
                model=MODEL,
                max_tokens=3,
                messages=[{"role": "robot", "content": "beep"}],  # type: ignore[typeddict-item]
            )
        assert error_type(refused.value) == "invalid_request_error"
        assert "role" in refused.value.message
