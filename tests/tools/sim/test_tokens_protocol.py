"""Tokenisation, chat rendering, output plans and request validation (pure)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gateway.tokenizer.words import VOCAB_SIZE, render_chat, tokenize
from tools.sim.config import SimConfig
from tools.sim.protocol import ApiError, GenerateParams, parse_generate, plan_output
from tools.sim.tokens import OutputText

CFG = SimConfig(max_model_len=100, output_len_min=5, output_len_max=10)


def params(**changes: Any) -> GenerateParams:
    body = {"prompt": "a b c", **changes}
    return parse_generate(body, chat=False)


def test_tokenize_is_one_id_per_word_and_stable() -> None:
    ids = tokenize("the quick  brown\nfox the")
    assert len(ids) == 5
    assert ids[0] == ids[4]
    assert ids == tokenize("the quick brown fox the")
    assert ids[0] == 1_011_183_078 + VOCAB_SIZE  # CRC-32 of "the": the same in every process


def test_generated_words_tokenize_back_to_the_generated_ids() -> None:
    out = OutputText(seed=42)
    assert tokenize(out.text(20)) == [out.token_id(i) for i in range(20)]


def test_chat_rendering_is_stable_and_keeps_text_parts() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
    ]
    assert render_chat(messages) == "<|system|> be brief\n<|user|> hi\n<|assistant|>"
    partial = [*messages, {"role": "assistant", "content": "so"}]
    open_ended = render_chat(partial, add_generation_prompt=False)
    assert open_ended == "<|system|> be brief\n<|user|> hi\n<|assistant|> so"


def test_completions_default_to_16_tokens_and_chat_to_the_room_left() -> None:
    assert params().max_tokens == 16
    chat = parse_generate({"messages": [{"role": "user", "content": "x"}]}, chat=True)
    assert chat.max_tokens is None
    # "<|user|> x <|assistant|>" is 3 tokens
    assert plan_output(dataclasses.replace(chat, ignore_eos=True), CFG)[0] == 100 - 3


def test_output_stops_at_a_seeded_length_unless_ignore_eos() -> None:
    n, reason, out = plan_output(params(max_tokens=50), CFG)
    assert 5 <= n <= 10
    assert reason == "stop"
    assert out.piece(n - 1) == ""  # the EOS token has no text
    assert plan_output(params(max_tokens=50), CFG)[0] == n  # same prompt, same answer
    assert plan_output(params(max_tokens=50, ignore_eos=True), CFG)[:2] == (50, "length")
    assert plan_output(params(max_tokens=3), CFG)[:2] == (3, "length")


def test_max_tokens_is_clamped_to_the_context_left() -> None:
    assert plan_output(params(prompt="w " * 98, max_tokens=50, ignore_eos=True), CFG)[0] == 2


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "w " * 100}, "maximum context length is 100 tokens"),
        (
            {"prompt": "x", "max_tokens": 101},
            "'max_tokens' or 'max_completion_tokens' is too large",
        ),
    ],
)
def test_length_errors_are_400(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ApiError, match=message) as info:
        plan_output(parse_generate(body, chat=False), CFG)
    assert info.value.status == 400


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"prompt": 5},
        {"prompt": ""},
        {"prompt": "x", "max_tokens": "3"},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "stream": False, "stream_options": {"include_usage": True}},
        {"prompt": "x", "n": 2},
        {"prompt": ["a", "b"]},
    ],
)
def test_invalid_completion_bodies_are_400(body: Any) -> None:
    with pytest.raises(ApiError) as info:
        parse_generate(body, chat=False)
    assert info.value.status == 400


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"messages": []},
        {"messages": [{"content": "x"}]},
        {"messages": [{"role": "u", "content": 3}]},
    ],
)
def test_invalid_chat_bodies_are_400(body: Any) -> None:
    with pytest.raises(ApiError):
        parse_generate(body, chat=True)


def test_token_id_prompts_and_batches_of_one_are_accepted() -> None:
    assert parse_generate({"prompt": [1, 2, 3]}, chat=False).prompt_ids == (1, 2, 3)
    assert parse_generate({"prompt": ["a b"]}, chat=False).echo_words == ("a", "b")


def test_echo_output_repeats_the_prompt() -> None:
    n, _, out = plan_output(
        params(prompt="one two", max_tokens=3, ignore_eos=True), CFG.replace(output="echo")
    )
    assert out.text(n) == " one two one"
