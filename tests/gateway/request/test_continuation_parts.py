"""The pure parts of stream continuation (``gateway.request.continuation``): bytes and JSON only."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.request.continuation import Keep, Progress, Stitch, can_resume, refusal, resume_body


def ev(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def text_chunk(text: str, **extra: Any) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": None, **extra}
    return ev({"id": "cmpl-a", "created": 7, "object": "text_completion", "choices": [choice]})


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({}, None),
        ({"stream": False}, "not_stream"),
        ({"n": 2}, "n"),
        ({"best_of": 3}, "n"),
        ({"echo": True}, "echo"),
        ({"logprobs": 2}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "structured_output"),
        ({"response_format": {"type": "text"}}, None),
        ({"guided_json": {}}, "structured_output"),
        ({"suffix": "end"}, "suffix"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": [1, 2, 3]}, None),
        ({"prompt": [[1, 2, 3]]}, None),
    ],
)
def test_what_may_be_continued_is_decided_from_the_request(
    extra: dict[str, Any], why: str | None
) -> None:
    doc = {"model": "m", "prompt": "hi", "stream": True, **extra}
    assert refusal(doc, chat=False) == why


def test_keep_holds_back_an_unfinished_event_until_its_end_arrives() -> None:
    keep = Keep(Progress(chat=False), compact_bytes=1 << 20)
    whole = text_chunk(" a") + text_chunk(" b")
    first, second = whole[:30], whole[30:]
    sent = keep.take(first)
    assert sent == b""  # half an event: the client could not parse it anyway
    sent += keep.take(second)
    assert sent == whole
    assert keep.progress().generated == " a b"


def test_keep_stops_at_the_engines_error_event_and_sends_what_came_before() -> None:
    keep = Keep(Progress(chat=False), compact_bytes=1 << 20)
    error = ev({"error": {"message": "EngineCore died", "type": "InternalServerError"}})
    sent = keep.take(text_chunk(" a") + error + b"data: [DONE]\n\n")
    assert sent == text_chunk(" a")
    assert keep.cut is not None
    assert "EngineCore died" in keep.cut
    assert keep.progress().done is False


def test_a_quoted_word_error_in_the_text_is_no_failure() -> None:
    keep = Keep(Progress(chat=False), compact_bytes=1 << 20)
    chunk = text_chunk(' "error" and "abort"')
    assert keep.take(chunk) == chunk
    assert keep.cut is None


def test_an_error_finish_is_a_failure_an_abort_or_length_finish_is_passed_on() -> None:
    for reason in ("length", "abort"):
        keep = Keep(Progress(chat=False), compact_bytes=1 << 20)
        chunk = text_chunk(" a", finish_reason=reason)
        assert keep.take(chunk) == chunk
        assert keep.cut is None
    keep = Keep(Progress(chat=False), compact_bytes=1 << 20)
    assert keep.take(text_chunk("", finish_reason="error")) == b""
    assert keep.cut is not None


def test_keep_parses_as_it_goes_past_its_compaction_bound_and_loses_nothing() -> None:
    keep = Keep(Progress(chat=False), compact_bytes=4096)
    for i in range(500):
        keep.take(text_chunk(f" w{i}"))
    progress = keep.progress()
    assert progress.generated == "".join(f" w{i}" for i in range(500))
    assert progress.events == 500


def test_a_tool_call_under_way_makes_a_chat_stream_not_continuable() -> None:
    p = Progress(chat=True)
    call = {"index": 0, "function": {"name": "f", "arguments": '{"a": '}}
    p.feed(ev({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}))
    assert can_resume({"messages": [{"role": "user", "content": "x"}]}, True, p) == "tool_call"


def test_reasoning_makes_a_chat_stream_not_continuable() -> None:
    p = Progress(chat=True)
    p.feed(ev({"id": "c", "choices": [{"index": 0, "delta": {"reasoning": "hmm"}}]}))
    assert can_resume({"messages": [{"role": "user", "content": "x"}]}, True, p) == "reasoning"


def test_a_token_prompt_continues_only_with_the_generated_ids() -> None:
    doc = {"model": "m", "prompt": [5, 6], "max_tokens": 10, "stream": True}
    p = Progress(chat=False)
    p.feed(text_chunk(" a"))
    assert can_resume(doc, False, p) == "token_prompt"
    p = Progress(chat=False)
    p.feed(text_chunk(" a", token_ids=[42]))
    assert can_resume(doc, False, p) is None
    assert resume_body(doc, False, p, 1)["prompt"] == [5, 6, 42]


def test_the_continuation_keeps_sampling_and_stops_and_lowers_the_budgets() -> None:
    doc = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_completion_tokens": 50,
        "min_tokens": 10,
        "temperature": 0.3,
        "stop": ["\n\n"],
        "stream_options": {"include_usage": False, "continuous_usage_stats": True},
    }
    p = Progress(chat=True)
    p.feed(
        ev({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    )
    p.feed(ev({"id": "c", "choices": [{"index": 0, "delta": {"content": "Hello"}}]}))
    body = resume_body(doc, True, p, 12)
    assert body["max_completion_tokens"] == 38
    assert body["min_tokens"] == 0
    assert (body["temperature"], body["stop"]) == (0.3, ["\n\n"])
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert (body["continue_final_message"], body["add_generation_prompt"]) == (True, False)
    assert doc["messages"] == [{"role": "user", "content": "hi"}]  # the original is unchanged


def test_a_client_that_continues_its_own_message_gets_it_extended_not_repeated() -> None:
    doc = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Once upon"},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "stream": True,
    }
    p = Progress(chat=True)
    p.feed(ev({"id": "c", "choices": [{"index": 0, "delta": {"content": " a time"}}]}))
    body = resume_body(doc, True, p, 2)
    assert body["messages"][-1] == {"role": "assistant", "content": "Once upon a time"}
    assert len(body["messages"]) == 2


def test_stitch_gives_the_first_streams_identity_and_whole_usage() -> None:
    p = Progress(chat=True)
    p.feed(ev({"id": "first", "created": 5, "choices": [{"index": 0, "delta": {"content": "ab"}}]}))
    stitch = Stitch(p, generated=4)
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    out = stitch.feed(
        ev({"id": "second", "created": 9, "choices": [role]})
        + ev({"id": "second", "created": 9, "choices": [{"index": 0, "delta": {"content": "cd"}}]})
        + ev(
            {"id": "second", "choices": [], "usage": {"prompt_tokens": 14, "completion_tokens": 6}}
        )
        + b"data: [DONE]\n\n"
    )
    parts = [json.loads(e[6:]) for e in out.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert len(parts) == 2  # no second role chunk
    assert {(d["id"], d.get("created", 5)) for d in parts} == {("first", 5)}
    assert parts[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}
    assert out.endswith(b"data: [DONE]\n\n")
    assert p.generated == "abcd"
    assert p.done


def test_stitch_stops_at_an_error_event_of_the_continuation() -> None:
    stitch = Stitch(Progress(chat=False), generated=0)
    out = stitch.feed(text_chunk(" a") + ev({"error": {"message": "boom"}}) + text_chunk(" b"))
    assert out == text_chunk(" a").replace(
        b'"object":"text_completion",', b'"object":"text_completion",'
    )
    assert stitch.cut is not None
