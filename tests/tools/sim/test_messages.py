"""Anthropic's Messages API on the simulator, as vLLM 0.32 serves it: the message and its
stream's named events, usage, count_tokens, the same prompt and answer as the equivalent
chat request, forced tool calls, errors, faults and aborts (and the official SDK)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import anthropic
import pytest
from anthropic.types import MessageParam, ToolParam

from gateway.tokenizer.words import tokenize
from tests.waiting import wait_for
from tools.sim import FAST, Faults, RunningSim, running_sim

from .conftest import assert_clean

WEATHER: dict[str, Any] = {
    "name": "weather",
    "description": "Today's weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}


def message_body(text: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {
        "model": FAST.model_name,
        "max_tokens": 1000,
        "messages": [{"role": "user", "content": text}],
        **extra,
    }


def named_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """An SSE body of named events: (event name, data), checking the framing."""
    text = raw.decode()
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        head, data = block.split("\n")
        assert head.startswith("event: "), block
        assert data.startswith("data: "), block
        events.append((head[len("event: ") :], json.loads(data[len("data: ") :])))
    return events


def check_stream_grammar(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Anthropic's streaming format: message_start, then content blocks (start, deltas,
    stop) with indices 0, 1, ... in order, message_delta, message_stop; each event's name
    is its data's type."""
    for name, data in events:
        assert data["type"] == name
    names = [name for name, _ in events]
    assert names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"]
    expected_index = 0
    open_index: int | None = None
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None
            assert data["index"] == expected_index
            open_index = expected_index
        elif name == "content_block_delta":
            assert data["index"] == open_index
        else:
            assert name == "content_block_stop"
            assert data["index"] == open_index
            open_index, expected_index = None, expected_index + 1
    assert open_index is None


async def post(
    client: aiohttp.ClientSession, url: str, body: Any
) -> tuple[int, dict[str, Any] | list[tuple[str, dict[str, Any]]]]:
    async with client.post(url, json=body) as resp:
        if resp.headers["Content-Type"].startswith("text/event-stream"):
            return resp.status, named_events(await resp.read())
        return resp.status, await resp.json()


async def test_a_message_and_its_stream_say_the_same_in_vllm_shapes(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    url = f"{sim.url}/v1/messages"
    status, full = await post(client, url, message_body())
    assert status == 200
    assert isinstance(full, dict)
    assert full["id"].startswith("chatcmpl-")  # vLLM keeps the chat completion's id
    assert (full["type"], full["role"], full["model"]) == ("message", "assistant", "sim-model")
    assert full["stop_reason"] == "end_turn"
    assert "stop_sequence" not in full  # vLLM drops null fields from a message
    [block] = full["content"]
    assert block["type"] == "text"
    usage = full["usage"]
    assert set(usage) == {"input_tokens", "output_tokens"}
    assert usage["input_tokens"] == 4  # "<|user|> hello there <|assistant|>"
    assert len(block["text"].split()) == usage["output_tokens"] - 1  # the EOS has no text

    async with client.post(url, json=message_body(stream=True)) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        raw = await resp.read()
    assert b"[DONE]" not in raw
    assert b"event: ping" not in raw  # vLLM sends none
    events = named_events(raw)
    check_stream_grammar(events)
    start = events[0][1]["message"]
    assert start["id"].startswith("chatcmpl-")
    assert start["content"] == []
    assert (start["stop_reason"], start["stop_sequence"]) == (None, None)
    assert start["usage"] == {"input_tokens": 4, "output_tokens": 0}
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert "".join(d["text"] for d in deltas) == block["text"]
    assert len(deltas) == usage["output_tokens"] - 1  # one per token; the EOS sends none
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"] == usage


async def test_max_tokens_cuts_the_answer(sim: RunningSim, client: aiohttp.ClientSession) -> None:
    status, full = await post(client, f"{sim.url}/v1/messages", message_body(max_tokens=5))
    assert status == 200
    assert isinstance(full, dict)
    assert full["stop_reason"] == "max_tokens"
    assert full["usage"]["output_tokens"] == 5
    assert len(full["content"][0]["text"].split()) == 5


async def test_count_tokens_is_the_streams_input_tokens(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = message_body(
        "what is the weather like",
        system=[{"type": "text", "text": "be brief"}],
        tools=[WEATHER],
    )
    count_body = {k: body[k] for k in ("model", "messages", "system", "tools")}
    status, counted = await post(client, f"{sim.url}/v1/messages/count_tokens", count_body)
    assert status == 200
    assert isinstance(counted, dict)
    n = counted["input_tokens"]
    assert counted == {"input_tokens": n, "context_management": {"original_input_tokens": n}}
    _, events = await post(client, f"{sim.url}/v1/messages", {**body, "stream": True})
    assert isinstance(events, list)
    assert events[0][1]["message"]["usage"]["input_tokens"] == n
    assert events[-2][1]["usage"]["input_tokens"] == n


async def test_a_message_and_the_equivalent_chat_render_one_prompt_and_answer(
    client: aiohttp.ClientSession,
) -> None:
    """vLLM's conversion: system first; tool_use as the assistant's tool_calls; a user's
    tool_result as a tool message before the rest of that user message."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "weather in Paris?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "let me look"},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "P"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny and warm"},
                {"type": "text", "text": "and"},
                {"type": "text", "text": "tomorrow?"},
            ],
        },
    ]
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "let me look",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "P"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny and warm"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "and"}, {"type": "text", "text": "tomorrow?"}],
        },
    ]
    body = {"model": "sim-model", "max_tokens": 50, "system": "be brief", "messages": messages}
    chat_body = {"model": "sim-model", "max_tokens": 50, "messages": chat}
    async with running_sim(FAST.replace(enable_scale_out=True)) as sim:
        _, rendered = await post(client, f"{sim.url}/v1/messages/render", body)
        _, chat_rendered = await post(client, f"{sim.url}/v1/chat/completions/render", chat_body)
        assert isinstance(rendered, dict)
        assert isinstance(chat_rendered, dict)
        assert rendered["token_ids"] == chat_rendered["token_ids"]
        text = "<|system|> be brief <|user|> weather in Paris? <|assistant|> let me look "
        text += "<|tool|> sunny and warm <|user|> and tomorrow? <|assistant|>"
        assert rendered["token_ids"] == tokenize(text)

        _, message = await post(client, f"{sim.url}/v1/messages", body)
        _, completion = await post(client, f"{sim.url}/v1/chat/completions", chat_body)
    assert isinstance(message, dict)
    assert isinstance(completion, dict)
    assert message["content"][0]["text"] == completion["choices"][0]["message"]["content"]
    assert message["usage"] == {
        "input_tokens": completion["usage"]["prompt_tokens"],
        "output_tokens": completion["usage"]["completion_tokens"],
    }
    assert message["usage"]["input_tokens"] == len(rendered["token_ids"])


async def test_stop_sequences_end_the_answer_as_the_chat_stop_does(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    url = f"{sim.url}/v1/messages"
    _, plain = await post(client, url, message_body(max_tokens=12))
    assert isinstance(plain, dict)
    words = plain["content"][0]["text"].split()
    stop = words[6][1:] + " " + words[7][:1]  # across two tokens: held back, then cut
    cut = plain["content"][0]["text"].split(stop)[0]

    _, full = await post(client, url, message_body(max_tokens=12, stop_sequences=["zzz", stop]))
    assert isinstance(full, dict)
    assert (full["stop_reason"], full["stop_sequence"]) == ("stop_sequence", stop)
    assert full["content"][0]["text"] == cut
    assert full["usage"]["output_tokens"] == 8  # the token completing the match counts

    _, events = await post(
        client, url, message_body(max_tokens=12, stop_sequences=["zzz", stop], stream=True)
    )
    assert isinstance(events, list)
    check_stream_grammar(events)
    deltas = [d["delta"]["text"] for n, d in events if n == "content_block_delta"]
    assert "".join(deltas) == cut
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}

    chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12}
    async with client.post(
        f"{sim.url}/v1/chat/completions", json={**chat, "stop": ["zzz", stop]}
    ) as resp:
        choice = (await resp.json())["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["message"]["content"] == cut


async def test_a_forced_tool_call_and_its_result_round_trip(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    url = f"{sim.url}/v1/messages"
    ask = message_body(
        "weather in Paris?", tools=[WEATHER], tool_choice={"type": "tool", "name": "weather"}
    )
    _, full = await post(client, url, ask)
    assert isinstance(full, dict)
    assert full["stop_reason"] == "tool_use"
    [call] = full["content"]
    assert call["type"] == "tool_use"
    assert call["id"].startswith("chatcmpl-tool-")  # vLLM's tool call ids
    assert call["name"] == "weather"
    assert set(call["input"]) == {"city", "days"}
    assert isinstance(call["input"]["city"], str)
    assert isinstance(call["input"]["days"], int)

    _, events = await post(client, url, {**ask, "stream": True})
    assert isinstance(events, list)
    check_stream_grammar(events)
    block = events[1][1]["content_block"]
    assert block == {"type": "tool_use", "id": block["id"], "name": "weather", "input": {}}
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert all(d["type"] == "input_json_delta" for d in deltas)
    assert json.loads("".join(d["partial_json"] for d in deltas)) == call["input"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert events[-2][1]["usage"] == full["usage"]

    _, any_tool = await post(client, url, {**ask, "tool_choice": {"type": "any"}})
    assert isinstance(any_tool, dict)
    assert any_tool["content"][0]["name"] == "weather"

    follow_up = message_body(tools=[WEATHER])
    follow_up["messages"] = [
        ask["messages"][0],
        {"role": "assistant", "content": full["content"]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": call["id"],
                    "content": [{"type": "text", "text": "sunny"}],
                }
            ],
        },
    ]
    _, answer = await post(client, url, follow_up)
    assert isinstance(answer, dict)
    assert answer["stop_reason"] == "end_turn"
    assert answer["content"][0]["type"] == "text"


async def test_a_tool_call_cut_by_max_tokens(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    """Its arguments are not JSON: vLLM's stream says max_tokens, its message fails."""
    url = f"{sim.url}/v1/messages"
    ask = message_body(max_tokens=2, tools=[WEATHER], tool_choice={"type": "any"})
    _, events = await post(client, url, {**ask, "stream": True})
    assert isinstance(events, list)
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    status, error = await post(client, url, ask)
    assert status == 400
    assert isinstance(error, dict)
    assert error["type"] == "error"
    assert error["error"]["type"] == "BadRequestError"
    assert error["error"]["message"].startswith("Expecting")  # the JSON decoder's


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        (
            message_body(model="nope"),
            404,
            {"type": "NotFoundError", "message": "The model `nope` does not exist."},
        ),
        (
            message_body(max_tokens=5000),
            400,
            {
                "type": "BadRequestError",
                "message": "'max_tokens' or 'max_completion_tokens' is too large: 5000. "
                "This model's maximum context length is 4096 tokens.",
            },
        ),
    ],
)
async def test_route_errors_are_anthropic_shaped(
    sim: RunningSim,
    client: aiohttp.ClientSession,
    *,
    body: dict[str, Any],
    status: int,
    error: dict[str, str],
) -> None:
    got_status, got = await post(client, f"{sim.url}/v1/messages", body)
    assert got_status == status
    assert got == {"type": "error", "error": error}


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        (
            {"model": "sim-model", "messages": []},
            "1 validation error:\n  {'type': 'missing', 'loc': 'body.max_tokens', "
            "'msg': 'Field required', 'input': '<dict of 2 items>'}",
            "body.max_tokens",
        ),
        (
            message_body(max_tokens=0),
            "1 validation error:\n  {'type': 'value_error', 'loc': 'body.max_tokens', "
            "'msg': 'Value error, max_tokens must be positive', 'input': '0', "
            "'ctx': {'error': ValueError('max_tokens must be positive')}}",
            "body.max_tokens",
        ),
        (
            {**message_body(), "messages": [{"role": "tool", "content": "x"}]},
            "1 validation error:\n  {'type': 'literal_error', 'loc': 'body.messages.0.role', "
            "'msg': \"Input should be 'user', 'assistant' or 'system'\", 'input': 'tool', "
            "'ctx': {'expected': \"'user', 'assistant' or 'system'\"}}",
            "body.messages.0.role",
        ),
        (
            {**message_body(), "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.messages.0.content', "
            "'msg': 'Input should be a valid string', 'input': '<list of 1 items>'}\n"
            "  {'type': 'literal_error', 'loc': 'body.messages.0.content.0.type', "
            "'msg': \"Input should be 'text', 'image', 'tool_use', 'tool_result', "
            "'tool_reference', 'thinking', 'redacted_thinking', 'tool_addition' or "
            "'tool_removal'\", 'input': 'video', 'ctx': {'expected': \"'text', 'image', "
            "'tool_use', 'tool_result', 'tool_reference', 'thinking', 'redacted_thinking', "
            "'tool_addition' or 'tool_removal'\"}}",
            "body.messages.0.content",
        ),
        (
            message_body(tool_choice={"type": "tool"}),
            "1 validation error:\n  {'type': 'value_error', 'loc': 'body.tool_choice', "
            "'msg': \"Value error, tool_choice.name is required when type is 'tool'\", "
            "'input': '<dict of 1 items>', 'ctx': {'error': "
            "ValueError(\"tool_choice.name is required when type is 'tool'\")}}",
            "body.tool_choice",
        ),
        (
            [1, 2],
            "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', "
            "'msg': 'Input should be a valid dictionary or object to extract fields from', "
            "'input': '<list of 2 items>'}",
            "body",
        ),
    ],
)
async def test_invalid_bodies_get_vllms_validation_error_not_anthropics(
    sim: RunningSim, client: aiohttp.ClientSession, *, body: Any, message: str, param: str
) -> None:
    """vLLM validates the body before the route translates errors: its OpenAI envelope."""
    status, got = await post(client, f"{sim.url}/v1/messages", body)
    assert status == 400
    assert got == {
        "error": {"message": message, "type": "Bad Request", "param": param, "code": 400}
    }


async def test_unparsable_bodies_are_validation_errors(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    url = f"{sim.url}/v1/messages"
    async with client.post(url, data=b"{", headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        assert (await r.json())["error"] == {
            "message": "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', "
            "'msg': 'JSON decode error', 'input': '<dict of 0 items>', "
            "'ctx': {'error': 'Expecting property name enclosed in double quotes'}}",
            "type": "Bad Request",
            "param": "body.1",
            "code": 400,
        }
    async with client.post(url, data=b"x=1") as r:
        assert r.status == 400
        assert (await r.json())["error"]["message"] == (
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
        )


async def test_an_engine_failure_mid_stream_is_vllms_error_event(
    client: aiohttp.ClientSession,
) -> None:
    """The chat layer's error chunk fails vLLM's converter, which sends its own error."""
    async with running_sim(FAST, Faults(error_after_tokens=3)) as sim:
        _, events = await post(client, f"{sim.url}/v1/messages", message_body(stream=True))
        assert isinstance(events, list)
        names = [n for n, _ in events]
        deltas = ["content_block_delta"] * 3
        assert names == ["message_start", "content_block_start", *deltas, "error"]
        error = events[-1][1]
        assert error["type"] == "error"
        assert error["error"]["type"] == "internal_error"
        assert error["error"]["message"].startswith(
            "2 validation errors for ChatCompletionStreamResponse\nmodel\n  Field required"
        )
        await wait_for(lambda: sim.state.in_flight == 0, within=10, what="handler done")
        assert sim.engine.stats.aborted["decode"] == 1
        assert_clean(sim)


async def test_injected_errors_are_anthropic_shaped(client: aiohttp.ClientSession) -> None:
    async with running_sim(FAST, Faults(error_rate=1.0, error_status=503)) as sim:
        status, got = await post(client, f"{sim.url}/v1/messages", message_body())
    assert status == 503
    assert got == {
        "type": "error",
        "error": {"type": "ServiceUnavailableError", "message": "Injected fault (simulator)."},
    }


async def test_a_client_gone_mid_stream_aborts_its_request(client: aiohttp.ClientSession) -> None:
    config = FAST.replace(output_len_min=3000, output_len_max=3000)
    async with running_sim(config) as sim:
        body = message_body(max_tokens=3500, stream=True)
        async with client.post(f"{sim.url}/v1/messages", json=body) as resp:
            deltas = 0
            async for line in resp.content:
                deltas += line.startswith(b"event: content_block_delta")
                if deltas == 5:
                    break
            resp.close()
        await wait_for(lambda: sim.engine.stats.aborted["decode"] == 1, within=10, what="abort")
        assert_clean(sim)
        assert sim.engine.stats.generation_tokens < 3000


async def test_prefix_cache_hits_are_reported_as_vllm_reports_them(
    client: aiohttp.ClientSession,
) -> None:
    """With --enable-prompt-tokens-details, input_tokens excludes the tokens read from and
    written to the prefix cache (vLLM's _build_anthropic_usage); message_start still has
    the whole prompt."""
    config = FAST.replace(enable_prompt_tokens_details=True)
    prompt = " ".join(f"w{i}" for i in range(40))  # 42 tokens with the role markers
    async with running_sim(config) as sim:
        url = f"{sim.url}/v1/messages"
        _, first = await post(client, url, message_body(prompt, max_tokens=3))
        _, events = await post(client, url, message_body(prompt, max_tokens=3, stream=True))
        _, chat = await post(
            client,
            f"{sim.url}/v1/chat/completions",
            {"messages": [{"role": "user", "content": prompt}], "max_tokens": 3},
        )
    assert isinstance(first, dict)
    assert first["usage"] == {
        "input_tokens": 42 - 32,
        "output_tokens": 3,
        "cache_creation_input_tokens": 32,  # two full blocks of 16 written
        "cache_read_input_tokens": 0,
    }
    assert isinstance(events, list)
    assert events[0][1]["message"]["usage"] == {"input_tokens": 42, "output_tokens": 0}
    assert events[-2][1]["usage"] == {
        "input_tokens": 42 - 32,
        "output_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 32,  # the same two blocks, read
    }
    assert isinstance(chat, dict)
    assert chat["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 32,
        "created_cache_tokens": 0,
        "multimodal_tokens": None,
    }


async def test_the_official_sdk_reads_messages_streams_and_counts(sim: RunningSim) -> None:
    sdk = anthropic.AsyncAnthropic(base_url=sim.url, api_key="unused", max_retries=0)
    weather: ToolParam = {"name": WEATHER["name"], "input_schema": WEATHER["input_schema"]}
    try:
        ask: list[MessageParam] = [{"role": "user", "content": "hello there"}]
        message = await sdk.messages.create(model="sim-model", max_tokens=1000, messages=ask)
        assert message.stop_reason == "end_turn"
        assert message.content[0].type == "text"
        async with sdk.messages.stream(model="sim-model", max_tokens=1000, messages=ask) as s:
            streamed = await s.get_final_message()
        assert streamed.content[0].type == "text"
        assert streamed.content[0].text == message.content[0].text
        assert streamed.usage.output_tokens == message.usage.output_tokens
        assert streamed.stop_reason == "end_turn"
        counted = await sdk.messages.count_tokens(model="sim-model", messages=ask)
        assert counted.input_tokens == message.usage.input_tokens
        tool = await sdk.messages.create(
            model="sim-model",
            max_tokens=100,
            messages=ask,
            tools=[weather],
            tool_choice={"type": "tool", "name": "weather"},
        )
        assert tool.content[0].type == "tool_use"
        with pytest.raises(anthropic.NotFoundError) as info:
            await sdk.messages.create(model="nope", max_tokens=5, messages=ask)
        assert info.value.body == {
            "type": "error",
            "error": {"type": "NotFoundError", "message": "The model `nope` does not exist."},
        }
    finally:
        await sdk.close()
