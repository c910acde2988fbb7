"""The Messages API's pure parts and stop strings: vLLM's conversion to chat, validation as
vLLM's models do it, forced tool inputs, and answers cut at stop strings."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from tools.sim.config import SimConfig
from tools.sim.messages_api import (
    ForcedTool,
    chat_messages,
    parse_messages,
    plan_tool,
    tool_input,
)
from tools.sim.protocol import parse_generate, plan_output
from tools.sim.tokens import OutputText, cut_at_stops, prompt_seed
from tools.sim.validation import BodyError

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "units": {"enum": ["C", "F"]},
        "when": {"type": "object", "properties": {"hour": {"type": "number"}}},
        "tags": {"type": "array", "items": {"type": "boolean"}},
    },
}


def test_messages_become_the_chat_vllm_converts_them_to() -> None:
    """Expected: vLLM 0.32's AnthropicServingMessages.to_chat_completion_request."""
    body = {
        "model": "m",
        "max_tokens": 9,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1;"},
            {"type": "text", "text": "be brief"},
            {"type": "text", "text": " ok"},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "use it", "signature": "s"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "x"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [
                            {"type": "text", "text": "sun"},
                            {"type": "text", "text": "ny"},
                        ],
                    },
                    {"type": "text", "text": "thanks"},
                ],
            },
            {"role": "system", "content": "inline"},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2"}]},
            {"role": "assistant", "content": [{"type": "tool_result", "content": "odd"}]},
        ],
    }
    assert chat_messages(body) == [
        {"role": "system", "content": "be brief ok"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "reasoning": "use it",
            "content": "calling",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"city": "x"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sun\nny"},
        {"role": "user", "content": "thanks"},
        {"role": "system", "content": "inline"},
        {"role": "tool", "tool_call_id": "t2", "content": ""},
        {"role": "assistant", "content": "Tool result: odd"},
    ]


def test_a_messages_request_is_the_chat_request_it_runs_as() -> None:
    req = parse_messages(
        {
            "model": "m",
            "max_tokens": "7",  # pydantic's lax mode
            "stream": "yes",
            "stop_sequences": ["END"],
            "messages": [{"role": "user", "content": "hi"}],
            "cache_salt": "salt",
            "vllm_xargs": {"a": 1},
        }
    )
    assert (req.max_tokens, req.stream, req.stop, req.cache_salt) == (7, True, ("END",), "salt")
    params = parse_generate(req.chat_body(), chat=True)
    chat = parse_generate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7},
        chat=True,
    )
    assert params.prompt_ids == chat.prompt_ids
    assert (params.max_tokens, params.stop, params.stream) == (7, ("END",), True)


def test_count_tokens_bodies_need_no_max_tokens() -> None:
    req = parse_messages(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, count_tokens=True
    )
    assert req.max_tokens is None
    with pytest.raises(BodyError) as info:
        parse_messages({"model": "m"}, count_tokens=True)
    assert info.value.message == (
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', "
        "'msg': 'Field required', 'input': '<dict of 1 items>'}"
    )
    assert info.value.param == "body.messages"


def test_every_problem_is_listed_in_field_order() -> None:
    """Expected: vLLM 0.32's answer to this body on /v1/messages."""
    with pytest.raises(BodyError) as info:
        parse_messages({"stream": 2, "temperature": "hot", "messages": "x"})
    assert info.value.envelope() == {
        "error": {
            "message": "5 validation errors:\n"
            "  {'type': 'missing', 'loc': 'body.model', 'msg': 'Field required', "
            "'input': '<dict of 3 items>'}\n"
            "  {'type': 'list_type', 'loc': 'body.messages', "
            "'msg': 'Input should be a valid list', 'input': 'x'}\n"
            "  {'type': 'missing', 'loc': 'body.max_tokens', 'msg': 'Field required', "
            "'input': '<dict of 3 items>'}\n"
            "  {'type': 'bool_parsing', 'loc': 'body.stream', "
            "'msg': 'Input should be a valid boolean, unable to interpret input', 'input': '2'}\n"
            "  {'type': 'float_parsing', 'loc': 'body.temperature', "
            "'msg': 'Input should be a valid number, unable to parse string as a number', "
            "'input': 'hot'}",
            "type": "Bad Request",
            "param": "body.model",
            "code": 400,
        }
    }


def test_nested_models_that_are_not_objects() -> None:
    with pytest.raises(BodyError) as info:
        parse_messages({"model": "m", "max_tokens": 5, "messages": ["x"]})
    assert info.value.message == (
        "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body.messages.0', "
        "'msg': 'Input should be a valid dictionary or object to extract fields from', "
        "'input': 'x'}"
    )


def test_a_forced_tool_input_follows_its_schema_the_same_every_time() -> None:
    value = tool_input(WEATHER, 42)
    assert value == tool_input(WEATHER, 42)
    assert value != tool_input(WEATHER, 43)
    assert set(value) == set(WEATHER["properties"])
    assert isinstance(value["city"], str)
    assert isinstance(value["days"], int)
    assert value["units"] in ("C", "F")
    assert isinstance(value["when"]["hour"], float)
    assert len(value["tags"]) == 1
    assert isinstance(value["tags"][0], bool)
    deep: dict[str, Any] = {"type": "object", "properties": {}}
    deep["properties"]["self"] = deep  # a recursive schema stops
    assert tool_input(deep, 3) == {"self": {"self": {"self": {"self": {}}}}}


def test_a_tool_call_is_its_jsons_words_then_eos() -> None:
    config = SimConfig()
    params = parse_generate({"messages": [{"role": "user", "content": "hi"}]}, chat=True)
    tool = ForcedTool("w", WEATHER)
    n, reason, output = plan_tool(params, config, tool)
    assert reason == "stop"
    assert output.piece(n - 1) == ""  # the EOS
    seed = prompt_seed(params.prompt_ids, config.seed)
    assert json.loads(output.text(n)) == tool_input(WEATHER, seed)
    assert n - 1 == len(output.text(n).split())
    cut = plan_tool(dataclasses.replace(params, max_tokens=2), config, tool)
    assert cut[:2] == (2, "length")


# -- stop strings (tokens.cut_at_stops), shared by every generate route


def test_a_stop_string_cuts_the_answer_and_streams_hold_text_back() -> None:
    out = OutputText(seed=0, source=("ab", "cd", "ef", "gh"))  # " ab cd ef gh ab ..."
    n, cut = cut_at_stops(out, 8, ["d e"])
    assert n == 3  # the token completing the match is generated
    assert cut.stop_reason == "d e"
    assert cut.text(n) == " ab c"
    assert [cut.piece(i) for i in range(n)] == [" ", "ab ", "c"]  # 2 characters held back
    n, cut = cut_at_stops(out, 8, ["gh ab", "f"])  # the match completing first wins
    assert (n, cut.stop_reason, cut.text(n)) == (3, "f", " ab cd e")


def test_without_a_match_the_last_token_releases_what_was_held() -> None:
    out = OutputText(seed=0, source=("ab", "cd"), eos_index=3)
    n, cut = cut_at_stops(out, 4, ["zzz"])
    assert n == 4
    assert cut.stop_reason is None
    assert "".join(cut.piece(i) for i in range(n)) == cut.text(n) == " ab cd ab"
    assert cut.piece(3) == "ab"  # the EOS brings the held-back text
    assert cut.token_id(3) == out.token_id(3)


@pytest.mark.parametrize("stop", ["x", ["x", "y"]])
def test_plans_take_stop_strings_from_the_request(stop: Any) -> None:
    params = parse_generate({"prompt": "a b", "max_tokens": 50, "stop": stop}, chat=False)
    assert params.stop in (("x",), ("x", "y"))
    count, _, output = plan_output(params, SimConfig(output_len_min=40, output_len_max=40))
    assert output.stop_reason is None or count < 40
