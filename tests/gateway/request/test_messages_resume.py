"""A broken Messages stream continued from a chat continuation (pure): what the client has
seen, the chat request for the rest, and the continuation rewritten into its events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.request.continuation import Keep
from gateway.request.messages_resume import (
    MessagesProgress,
    MessagesStitch,
    messages_refusal,
    messages_resume_body,
)
from tests.anthropic_stream import read_stream


def named(name: str, doc: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(doc)}\n\n".encode()


def start(input_tokens: int = 12) -> bytes:
    message = {
        "id": "chatcmpl-1",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "m",
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }
    return named("message_start", {"type": "message_start", "message": message})


def text_block(index: int = 0) -> bytes:
    block = {"type": "text", "text": ""}
    return named(
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": block},
    )


def delta(text: str, index: int = 0) -> bytes:
    d = {"type": "text_delta", "text": text}
    return named("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})


def chat(content: str | None = None, finish: str | None = None, **delta_: Any) -> bytes:
    d: dict[str, Any] = {**delta_}
    if content is not None:
        d["content"] = content
    doc = {"id": "chatcmpl-9", "choices": [{"index": 0, "delta": d, "finish_reason": finish}]}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def chat_usage(prompt: int, completion: int) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    return b"data: " + json.dumps({"id": "c", "choices": [], "usage": usage}).encode() + b"\n\n"


BODY: dict[str, Any] = {
    "model": "m",
    "max_tokens": 10,
    "stream": True,
    "system": "Be brief.",
    "temperature": 0,
    "stop_sequences": ["END"],
    "messages": [{"role": "user", "content": "Count"}],
}


def seen(*events: bytes) -> MessagesProgress:
    keep = Keep(MessagesProgress(), compact_bytes=1 << 20)
    for e in events:
        keep.take(e)
    return keep.progress()


def test_what_the_client_saw_of_a_text_answer() -> None:
    p = seen(start(12), text_block(), delta("one "), delta("two "))
    assert p.generated == "one two "
    assert p.events == 2
    assert p.input_tokens == 12
    assert p.open_block == 0
    assert p.blocker is None
    assert p.finished is None
    assert not p.done


@pytest.mark.parametrize(
    ("block", "blocker"),
    [
        ({"type": "tool_use", "id": "t", "name": "f", "input": {}}, "tool_use"),
        ({"type": "thinking", "thinking": ""}, "thinking"),
    ],
)
def test_a_tool_call_or_thinking_under_way_is_not_continued(
    block: dict[str, Any], blocker: str
) -> None:
    opened = named(
        "content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}
    )
    assert seen(start(), opened).blocker == blocker


def test_an_error_event_stops_what_reaches_the_client() -> None:
    keep = Keep(MessagesProgress(), compact_bytes=1 << 20)
    err = named("error", {"type": "error", "error": {"type": "internal_error", "message": "x"}})
    assert keep.take(start(), events=1) == start()
    assert keep.take(err, events=1) == b""
    assert keep.cut is not None


def test_the_rest_is_asked_for_as_the_chat_vllm_renders_continued() -> None:
    body = messages_resume_body(BODY, seen(start(), text_block(), delta("one two")), 3)
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Count"},
        {"role": "assistant", "content": "one two"},
    ]
    assert body["continue_final_message"] is True
    assert body["add_generation_prompt"] is False
    assert body["max_tokens"] == 7
    assert body["stop"] == ["END"]
    assert body["temperature"] == 0
    assert body["stream"] is True
    assert body["stream_options"]["include_usage"] is True
    assert "system" not in body
    assert "stop_sequences" not in body


def test_the_continuation_goes_on_in_the_open_block_and_ends_the_message_once() -> None:
    before = start(12) + text_block() + delta("one ") + delta("two ")
    p = seen(before)
    stitch = MessagesStitch(p, generated=2)
    after = b"".join(
        stitch.feed(e)
        for e in (
            chat(role="assistant", content=""),
            chat("three "),
            chat("four", finish="length"),
            chat_usage(prompt=14, completion=2),
            b"data: [DONE]\n\n",
        )
    )
    stream = read_stream(before + after)
    assert stream.text == "one two three four"
    assert len(stream.blocks) == 1
    assert stream.stop_reason == "max_tokens"
    assert stream.usage == {"input_tokens": 12, "output_tokens": 4}
    assert stream.names.count("message_delta") == 1
    assert p.done
    assert stitch.feed(chat("more")) == b""  # nothing after the end


def test_a_block_the_client_saw_closed_is_followed_by_a_new_one() -> None:
    stop = named("content_block_stop", {"type": "content_block_stop", "index": 0})
    before = start() + text_block() + delta("one") + stop
    stitch = MessagesStitch(seen(before), generated=1)
    after = stitch.feed(chat(" two", finish="stop", stop_reason="END"))
    after += stitch.feed(chat_usage(5, 1) + b"data: [DONE]\n\n")
    stream = read_stream(before + after)
    assert [b["text"] for b in stream.blocks] == ["one", " two"]
    assert stream.stop_reason == "end_turn"


def test_a_stop_sequence_is_reported_as_vllm_does() -> None:
    before = start() + text_block() + delta("a")
    stitch = MessagesStitch(seen(before), generated=1)
    doc = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "END"}]}
    after = stitch.feed(b"data: " + json.dumps(doc).encode() + b"\n\n" + b"data: [DONE]\n\n")
    stream = read_stream(before + after)
    assert stream.stop_reason == "stop_sequence"


def test_a_continuation_that_calls_a_tool_or_fails_is_cut() -> None:
    stitch = MessagesStitch(seen(start(), text_block(), delta("a")), generated=1)
    call = {"index": 0, "id": "c", "function": {"name": "f", "arguments": ""}}
    assert stitch.feed(chat(tool_calls=[call])) == b""
    assert stitch.cut is not None
    failing = MessagesStitch(seen(start(), text_block(), delta("a")), generated=1)
    assert failing.feed(b'data: {"error": {"message": "boom"}}\n\n') == b""
    assert failing.cut is not None


def test_which_messages_streams_can_be_continued() -> None:
    assert messages_refusal(BODY) is None
    assert messages_refusal({**BODY, "stream": False}) == "not_stream"
    assert messages_refusal({**BODY, "messages": []}) == "prompt"
    fmt = {"format": {"type": "json_schema", "schema": {}}}
    assert messages_refusal({**BODY, "output_config": fmt}) == "structured_output"
