"""The pure parts of Anthropic's Messages API in the gateway: the body as vLLM renders it, the
errors in Anthropic's shape, the first token and the usage of a Messages stream."""

from __future__ import annotations

import json

from backends.errors import (
    BackendRefused,
    BudgetExceeded,
    ModelNotFound,
    NoBackendAvailable,
    RateLimited,
    UpstreamTimeout,
)
from gateway.limits.tokens import UsageFilter, estimate_prompt_tokens, usage_from_body
from gateway.request.dialects import ANTHROPIC, OPENAI, dialect_of
from gateway.request.endpoints import is_route_missing
from gateway.request.messages import chat_view
from gateway.request.sse import carries_token


def test_the_system_prompt_comes_first_and_blocks_become_chat_content() -> None:
    doc = {
        "model": "m",
        "max_tokens": 9,
        "stream": True,
        "metadata": {"user_id": "u"},
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
            {"type": "text", "text": "You are "},
            {"type": "text", "text": "terse."},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "one"},
                    {"type": "text", "text": "two"},
                ],
            },
            {"role": "user", "content": "go on"},
        ],
    }
    view = chat_view(doc)
    assert view["model"] == "m"
    assert view["max_tokens"] == 9
    assert view["stream"] is True
    assert "metadata" not in view
    assert "system" not in view
    assert view["messages"] == [
        {"role": "system", "content": "You are terse."},  # the billing header left out
        {"role": "user", "content": "hi"},  # one text block: a string, as vLLM makes it
        {
            "role": "assistant",
            "reasoning": "hmm",
            "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
        },
        {"role": "user", "content": "go on"},
    ]


def test_a_tool_round_trip_becomes_tool_calls_and_a_tool_message() -> None:
    doc = {
        "model": "m",
        "max_tokens": 9,
        "tools": [
            {
                "name": "weather",
                "description": "Today's weather",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
            }
        ],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "weather",
                        "input": {"city": "Paris"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "sunny"}],
                    }
                ],
            },
        ],
    }
    view = chat_view(doc)
    assert view["messages"][1:] == [
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        # A user turn of tool results only is the tool messages, and no user message.
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
    ]
    assert view["tools"][0]["function"]["name"] == "weather"
    assert view["tools"][0]["function"]["parameters"]["properties"] == {"city": {"type": "string"}}


def test_malformed_parts_are_left_to_the_engine_to_refuse() -> None:
    view = chat_view({"model": "m", "system": 7, "messages": [3, {"role": "user", "content": [5]}]})
    assert view == {"model": "m", "messages": []}
    assert chat_view({"model": "m", "messages": "no"})["messages"] == []


def test_the_system_prompt_counts_in_the_limits_estimate() -> None:
    bare = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with_system = {**bare, "system": "s" * 4000}
    assert estimate_prompt_tokens(chat_view(with_system)) >= estimate_prompt_tokens(bare) + 1000


def test_errors_on_messages_paths_are_in_anthropics_shape() -> None:
    assert dialect_of("/v1/messages") is ANTHROPIC
    assert dialect_of("/v1/messages/count_tokens") is ANTHROPIC
    assert dialect_of("/v1/messagesx") is OPENAI
    assert dialect_of("/v1/chat/completions") is OPENAI
    limited = RateLimited("slow down", limit_type="requests", headers={"Retry-After": "3"})
    assert limited.shaped("anthropic") == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    assert limited.shaped("openai")["error"]["type"] == "requests"
    kinds = {
        ModelNotFound("no such model"): "not_found_error",
        BudgetExceeded("spent"): "rate_limit_error",
        NoBackendAvailable("none", retry_after=1): "overloaded_error",
        UpstreamTimeout("late"): "timeout_error",
    }
    for err, kind in kinds.items():
        assert err.shaped("anthropic")["error"]["type"] == kind, err


def test_a_backends_refusal_keeps_its_anthropic_body_or_is_translated() -> None:
    theirs = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    refused = BackendRefused("b", 503, json.dumps(theirs).encode(), retry_after=None)
    assert refused.shaped("anthropic") == theirs
    openai_body = {"error": {"message": "queue full", "type": "x", "code": 429}}
    refused = BackendRefused("b", 429, json.dumps(openai_body).encode(), retry_after="2")
    assert refused.shaped("anthropic") == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "queue full"},
    }
    assert refused.shaped("openai") == openai_body


def test_an_error_inside_a_messages_stream_is_an_error_event() -> None:
    raw = ANTHROPIC.error_event(UpstreamTimeout("late"))
    event, data = raw.decode().rstrip("\n").split("\n")
    assert event == "event: error"
    assert json.loads(data.removeprefix("data: "))["error"]["type"] == "timeout_error"
    assert b"[DONE]" not in raw
    assert OPENAI.error_event(UpstreamTimeout("late")).endswith(b"data: [DONE]\n\n")


def test_the_first_token_of_a_messages_stream_is_a_content_delta() -> None:
    start = {"type": "message_start", "message": {"content": [], "usage": {"input_tokens": 3}}}
    block = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    text = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "a"}}
    tool = {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "input_json_delta", "partial_json": '{"'},
    }
    empty = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": ""}}
    for doc, carries in (
        (start, False),
        (block, False),
        (text, True),
        (tool, True),
        (empty, False),
    ):
        assert carries_token(json.dumps(doc).encode()) is carries, doc


def test_usage_of_a_messages_answer_counts_cached_input_as_prompt() -> None:
    body = {"usage": {"input_tokens": 4, "cache_read_input_tokens": 16, "output_tokens": 7}}
    usage = usage_from_body(json.dumps(body).encode())
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (20, 7, 27)
    delta = {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens"},
        "usage": body["usage"],
    }
    f = UsageFilter(strip=False)
    raw = b"event: message_delta\ndata: " + json.dumps(delta).encode() + b"\n\n"
    assert f.feed(raw) == raw
    assert f.usage is not None
    assert f.usage.completion_tokens == 7


def test_a_scale_out_route_on_a_server_without_the_flag_is_a_missing_route() -> None:
    body = json.dumps(
        {
            "error": {
                "message": "Scale-out endpoints are disabled. Restart vllm serve with "
                "--enable-scale-out to enable them.",
                "type": "PermissionDeniedError",
                "param": None,
                "code": 403,
            }
        }
    ).encode()
    assert is_route_missing(403, body)
    assert not is_route_missing(403, b'{"error": {"message": "forbidden"}}')
