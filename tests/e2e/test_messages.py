"""Anthropic's Messages API through the gateway in front of two real vLLM servers (the tiny
model), with the official ``anthropic`` client unchanged but for its base URL: a message and a
stream, ``count_tokens``, a tool's round trip, the SDK's typed errors (an unknown model, a
body vLLM refuses, a rate limit); the prompt the gateway renders for a Messages body is the
one vLLM renders (``/v1/messages/render``, on the server started with ``--enable-scale-out``,
which the gateway finds by passing over the one without it); and a stream whose server is
SIGKILLed mid-way goes on from the other server, the client none the wiser."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import pytest

from gateway.limits.keys import hash_key
from gateway.request.messages import chat_view
from tests.anthropic_stream import read_stream
from tests.e2e.conftest import SCALE_OUT
from tests.e2e.servers import (
    MODEL_DIR,
    SERVED_MODEL,
    START_DEADLINE,
    VllmServer,
    gateway_for,
    kill,
)
from tests.e2e.test_continuation import continued, killing
from tests.helpers import RunningGateway, sample, wait_for

pytestmark = pytest.mark.timeout(START_DEADLINE + 120)

KEY = "sk-ant-e2e"
USER = [{"role": "user", "content": "The gateway keeps the stream alive:"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}
# The SDK's create() takes no temperature any more: greedy is asked for in the body.
GREEDY: dict[str, Any] = {"temperature": 0.0}
N_TOKENS = 1500
KILL_AFTER = 20  # events received before the server producing them is killed


@pytest.fixture
async def sdk(gateway: RunningGateway) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(
        base_url=gateway.url, api_key="not-checked", max_retries=0, timeout=120.0
    ) as client:
        yield client


async def test_messages_streams_and_token_counts_through_the_sdk(
    sdk: anthropic.AsyncAnthropic, gateway: RunningGateway
) -> None:
    message = await sdk.messages.create(
        model=SERVED_MODEL, max_tokens=12, extra_body=GREEDY, messages=USER, system="Be brief."
    )
    assert message.role == "assistant"
    assert message.content[0].type == "text"
    assert message.usage.output_tokens <= 12
    counted = await sdk.messages.count_tokens(model=SERVED_MODEL, messages=USER, system="Be brief.")
    assert counted.input_tokens == message.usage.input_tokens
    async with sdk.messages.stream(
        model=SERVED_MODEL, max_tokens=12, extra_body=GREEDY, messages=USER, system="Be brief."
    ) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == message.content[0].text  # greedy: the same answer
    assert final.usage.output_tokens == message.usage.output_tokens
    assert final.usage.input_tokens == message.usage.input_tokens

    def answered() -> float:  # counted once the handler is done, just after the stream ends
        return sum(
            sample(
                gateway,
                "llm_gateway_requests_total",
                model=SERVED_MODEL,
                backend=b.id,
                status="200",
                endpoint="messages",
            )
            for b in gateway.svc.pool.all()
        )

    await wait_for(lambda: answered() == 2, what="both counted as messages, 200")


async def test_a_tool_round_trip(sdk: anthropic.AsyncAnthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = await sdk.messages.create(
        model=SERVED_MODEL,
        max_tokens=60,
        extra_body=GREEDY,
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses, first
    assert uses[0].name == "get_weather"
    assert uses[0].input in ({"city": "Paris"}, {"city": "Rome"})
    second = await sdk.messages.create(
        model=SERVED_MODEL,
        max_tokens=8,
        extra_body=GREEDY,
        tools=[WEATHER],
        messages=[
            *ask,
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in first.content],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}],
            },
        ],
    )
    assert second.stop_reason in ("max_tokens", "end_turn")
    assert second.usage.input_tokens > first.usage.input_tokens


async def test_errors_are_the_sdks_typed_errors(servers: list[VllmServer]) -> None:
    limits = {
        "auth": True,
        "tiers": {"default": {"requests_per_minute": 2}},
        "keys": [{"name": "e2e", "hash": hash_key(KEY)}],
    }
    async with (
        gateway_for(servers, limits=limits) as gw,
        anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0, timeout=120.0) as sdk,
    ):
        with pytest.raises(anthropic.NotFoundError) as unknown:
            await sdk.messages.create(model="no-such-model", max_tokens=2, messages=USER)
        assert unknown.value.body["type"] == "error"  # type: ignore[index]
        with pytest.raises(anthropic.BadRequestError) as refused:  # vLLM's own 400
            await sdk.messages.create(
                model=SERVED_MODEL,
                max_tokens=2,
                messages=[{"role": "robot", "content": "x"}],  # type: ignore[list-item]
            )
        assert refused.value.body["type"] == "error"  # type: ignore[index]
        with pytest.raises(anthropic.RateLimitError) as limited:
            await sdk.messages.create(model=SERVED_MODEL, max_tokens=2, messages=USER)
        assert int(limited.value.response.headers["retry-after"]) >= 1
        async with anthropic.AsyncAnthropic(
            base_url=gw.url, api_key="sk-wrong", max_retries=0
        ) as bad:
            with pytest.raises(anthropic.AuthenticationError):
                await bad.messages.create(model=SERVED_MODEL, max_tokens=2, messages=USER)


async def test_the_gateway_renders_a_messages_body_as_vllm_does(
    servers: list[VllmServer], http: httpx.AsyncClient
) -> None:
    """Through the gateway, ``/v1/messages/render`` reaches the one server with scale-out on
    (the other's 403 passes it over); its token ids are what the gateway's tokenizer makes of
    the body's chat view, which precise prefix routing hashes."""
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "max_tokens": 5,
        "system": [{"type": "text", "text": "You are "}, {"type": "text", "text": "a router."}],
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Looking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Rome"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
                    {"type": "text", "text": "Umbrella?"},
                ],
            },
        ],
    }
    tokenizers = {SERVED_MODEL: str(MODEL_DIR)}
    async with gateway_for(servers, tokenizers=tokenizers) as gw:
        for _ in range(3):  # whichever server the policy picks first, the answer comes from one
            r = await http.post(f"{gw.url}/v1/messages/render", json=body)
            assert r.status_code == 200, r.text
            rendered = r.json()["token_ids"]
        tok = gw.svc.tokenizers.get(SERVED_MODEL)
        assert tok is not None
        assert tok.prompt_tokens("chat", chat_view(body)) == rendered
        without = next(s for s in servers if s.name != SCALE_OUT)
        state = next(b for b in gw.svc.pool.all() if b.spec.url == without.url)
        # Learned from its 403 if the policy tried it first (it may not have): never served it.
        assert (
            sample(
                gw,
                "llm_gateway_requests_total",
                model=SERVED_MODEL,
                backend=state.id,
                status="200",
                endpoint="render",
            )
            == 0
        )
    direct = await http.post(f"{without.url}/v1/messages/render", json=body)
    assert direct.status_code == 403  # the server without the flag


async def test_a_messages_stream_survives_its_server_being_killed(
    gateway: RunningGateway, servers: list[VllmServer], http: httpx.AsyncClient
) -> None:
    body = {"model": SERVED_MODEL, "max_tokens": N_TOKENS, "temperature": 0.0, "messages": USER}
    whole = (await http.post(f"{gateway.url}/v1/messages", json=body, timeout=300)).json()
    assert whole["stop_reason"] == "max_tokens", whole["stop_reason"]  # no EOS in the way
    assert whole["usage"]["output_tokens"] == N_TOKENS
    for _ in range(3):  # a run where the kill came too late proves nothing: again
        before = continued(gateway)
        raw = bytearray()
        async with killing(gateway, servers) as killer:
            async with http.stream(
                "POST", f"{gateway.url}/v1/messages", json={**body, "stream": True}, timeout=300
            ) as r:
                assert r.status_code == 200
                events = 0
                async for chunk in r.aiter_bytes():
                    raw += chunk
                    events += chunk.count(b"\n\n")
                    if killer.victim is None and events >= KILL_AFTER:
                        if not any(b.in_flight for b in gateway.svc.pool.all()):
                            break  # the whole answer is already at the gateway
                        busy = next(b.spec.url for b in gateway.svc.pool.all() if b.in_flight)
                        killer.victim = next(s for s in servers if s.url == busy)
                        await asyncio.to_thread(kill, killer.victim)
        if killer.victim is None or continued(gateway) == before:
            continue
        stream = read_stream(bytes(raw))
        assert stream.error is None
        assert stream.stop_reason == "max_tokens"
        assert stream.usage["output_tokens"] == N_TOKENS
        assert stream.usage["input_tokens"] == whole["usage"]["input_tokens"]
        first_difference = next(
            (
                i
                for i, (a, b) in enumerate(
                    zip(stream.text, whole["content"][0]["text"], strict=False)
                )
                if a != b
            ),
            None,
        )
        # The text sent back is retokenized by the continuing server: said, not asserted.
        print(
            f"messages: {N_TOKENS} tokens; first character differing from the whole answer: "
            f"{first_difference}"
        )
        return
    raise AssertionError("three times the kill came after vLLM had sent the whole stream")
