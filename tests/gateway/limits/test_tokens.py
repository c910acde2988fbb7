"""Token estimates, usage extraction and the usage-chunk filter (pure)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from gateway.limits.tokens import (
    Usage,
    UsageFilter,
    completion_budget,
    estimate_prompt_tokens,
    reservation,
    usage_from_body,
    usage_plan,
    with_include_usage,
)
from tools.fake_vllm import chat_chunk, sse
from tools.sim.testing import FAST, running_sim


def usage_event(prompt: int = 5, completion: int = 7) -> bytes:
    return sse(
        {
            "id": "chatcmpl-x",
            "object": "chat.completion.chunk",
            "choices": [],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        }
    )


def test_prompt_estimate_counts_characters_of_a_completion_prompt() -> None:
    assert estimate_prompt_tokens({"prompt": "x" * 9}) == 3  # ceil(9 / 4)
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3  # token ids count as they are
    assert estimate_prompt_tokens({"prompt": ["abcd", "efgh"]}) == 2


def test_prompt_estimate_counts_messages_with_overhead_and_parts() -> None:
    doc: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": "x" * 8},
            {"role": "user", "content": [{"type": "text", "text": "y" * 4}]},
        ]
    }
    assert estimate_prompt_tokens(doc) == 3 + 2 * 4
    assert estimate_prompt_tokens(doc, chars_per_token=2.0) == 6 + 2 * 4


def test_completion_budget_prefers_max_completion_tokens_then_max_tokens_then_default() -> None:
    assert completion_budget({"max_completion_tokens": 5, "max_tokens": 9}, 100) == 5
    assert completion_budget({"max_tokens": 9}, 100) == 9
    assert completion_budget({}, 100) == 100
    assert completion_budget({"max_tokens": "lots"}, 100) == 100
    assert completion_budget({"max_tokens": 10, "n": 3}, 100) == 30
    assert completion_budget({"prompt": ["a", "b"], "max_tokens": 10}, 100) == 20


def test_reservation_is_prompt_plus_completion() -> None:
    doc = {"messages": [{"role": "user", "content": "z" * 40}], "max_tokens": 50}
    assert reservation(doc) == 10 + 4 + 50


def test_usage_from_a_non_stream_body() -> None:
    body = json.dumps(
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    ).encode()
    assert usage_from_body(body) == Usage(3, 4, 7)
    assert usage_from_body(b'{"choices": []}') is None
    assert usage_from_body(b"not json") is None
    responses = {"usage": {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}}
    assert usage_from_body(json.dumps(responses).encode()) == Usage(5, 2, 7)  # Responses API


def test_usage_plan_asks_for_usage_only_when_the_client_did_not() -> None:
    assert usage_plan({"stream": False}) == usage_plan({})
    assert not usage_plan({}).inject
    assert usage_plan({"stream": True}).inject
    assert usage_plan({"stream": True}).strip
    asked = usage_plan({"stream": True, "stream_options": {"include_usage": True}})
    assert not asked.inject
    assert not asked.strip


def test_with_include_usage_keeps_other_stream_options() -> None:
    doc = {"model": "m", "stream": True, "stream_options": {"continuous_usage_stats": False}}
    sent = json.loads(with_include_usage(doc))
    assert sent["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert doc["stream_options"] == {"continuous_usage_stats": False}  # the input is untouched


def test_filter_removes_the_usage_chunk_for_a_client_that_did_not_ask() -> None:
    f = UsageFilter(strip=True)
    token = chat_chunk("hi")
    assert f.event(token) is token  # no "usage" in it: passed through without parsing
    assert f.event(usage_event()) == b""
    assert f.event(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
    assert f.usage == Usage(5, 7, 12)


def test_filter_keeps_the_usage_chunk_for_a_client_that_asked() -> None:
    f = UsageFilter(strip=False)
    ev = usage_event()
    assert f.event(ev) is ev
    assert f.usage == Usage(5, 7, 12)


def test_filter_ignores_a_null_usage_field() -> None:
    f = UsageFilter(strip=True)
    ev = sse({"choices": [{"index": 0, "delta": {"content": "a"}}], "usage": None})
    assert f.event(ev) == ev
    assert f.usage is None


def test_feed_strips_the_usage_chunk_across_any_split_of_the_stream() -> None:
    stream = (
        chat_chunk(role=True) + chat_chunk("a") + chat_chunk(finish="stop") + usage_event()
        + b"data: [DONE]\n\n"
    )  # fmt: skip
    expected = stream.replace(usage_event(), b"")
    for size in (1, 2, 7, 64, len(stream)):
        f = UsageFilter(strip=True)
        out = b"".join(f.feed(stream[i : i + size]) for i in range(0, len(stream), size))
        out += f.flush()
        assert out == expected, size
        assert f.usage == Usage(5, 7, 12)


def test_feed_without_strip_returns_every_read_at_once_and_still_sees_usage() -> None:
    stream = chat_chunk("a") + usage_event() + b"data: [DONE]\n\n"
    f = UsageFilter(strip=False)
    reads = [stream[i : i + 5] for i in range(0, len(stream), 5)]
    assert [f.feed(r) for r in reads] == reads
    assert f.flush() == b""
    assert f.usage == Usage(5, 7, 12)


def test_feed_handles_crlf_event_boundaries() -> None:
    ev = usage_event().replace(b"\n", b"\r\n")
    f = UsageFilter(strip=True)
    assert f.feed(ev[:10]) == b""
    assert f.feed(ev[10:]) == b""
    assert f.usage == Usage(5, 7, 12)


async def test_usage_read_and_stripped_from_a_vllm_compatible_stream() -> None:
    """Against the simulator: ask for usage on the client's behalf, read it, hide it."""
    doc: dict[str, Any] = {
        "model": FAST.model_name,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8,
        "stream": True,
    }
    plan = usage_plan(doc)
    assert plan.inject
    body = with_include_usage(doc)
    f = UsageFilter(strip=plan.strip)
    forwarded = b""
    async with running_sim(FAST) as sim, aiohttp.ClientSession() as session:
        async with session.post(
            f"{sim.url}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        ) as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_any():
                forwarded += f.feed(chunk)
    forwarded += f.flush()
    assert f.usage is not None
    assert f.usage.completion_tokens == 8
    assert f.usage.total_tokens == f.usage.prompt_tokens + 8
    assert b'"usage"' not in forwarded
    assert forwarded.endswith(b"data: [DONE]\n\n")
    assert forwarded.count(b"data: ") >= 9  # role chunk, 8 tokens (some may share), [DONE]


def test_with_include_usage_appends_to_the_raw_body_without_reserialising() -> None:
    raw = b'{"model": "m",  "stream": true, "messages": [{"role": "user", "content": "x"}]} \n'
    doc = json.loads(raw)
    sent = with_include_usage(doc, raw)
    assert sent.startswith(raw.rstrip()[:-1])  # the client's bytes, untouched
    assert json.loads(sent) == doc | {"stream_options": {"include_usage": True}}
    asked_other = doc | {"stream_options": {"continuous_usage_stats": False}}
    both = json.loads(with_include_usage(asked_other, json.dumps(asked_other).encode()))
    assert both["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
