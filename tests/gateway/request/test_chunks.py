"""The per-read work of a stream relay (``gateway.request.relay.Chunks``), as plain calls."""

from __future__ import annotations

import json

import pytest

from backends.upstream.idle import IdleWatch
from gateway.limits.tokens import UsageFilter
from gateway.request.record import Ending
from gateway.request.relay import Chunks, RelayResult, partial_tail

SERVED, ALIAS = b'"model":"m-v2"', b'"model":"chat"'


def stream(n: int = 3) -> bytes:
    """A vLLM-shaped event stream (compact JSON, as vLLM writes it), usage chunk included."""
    events = [
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "model": "m-v2",
            "choices": [{"delta": {"content": f"w{i}"}}],
        }
        for i in range(n)
    ]
    events.append(
        {
            "id": "c1",
            "model": "m-v2",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": n},
        }
    )
    body = b"".join(
        b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events
    )
    return body + b"data: [DONE]\n\n"


def chunks(*, strip: bool = False) -> tuple[Chunks, RelayResult]:
    result = RelayResult(ending=Ending.COMPLETE)
    watch = IdleWatch(lambda: None, 0.0)
    return Chunks(watch, result, UsageFilter(strip=strip), lambda: 1.0, (SERVED, ALIAS)), result


@pytest.mark.parametrize("strip", [False, True])
def test_the_model_is_renamed_wherever_the_reads_split_the_stream(strip: bool) -> None:
    raw = stream()
    for cut in range(1, len(raw)):
        c, _ = chunks(strip=strip)
        out = c.take(raw[:cut]) + c.take(raw[cut:]) + c.rest()
        assert SERVED not in out, cut
        assert out.count(ALIAS) == (3 if strip else 4), cut  # strip: the usage chunk is gone


def test_a_read_ending_with_whole_events_is_sent_at_once() -> None:
    raw = stream()
    first = raw.index(b"\n\n") + 2
    c, _ = chunks()
    assert c.take(raw[:first]) == raw[:first].replace(SERVED, ALIAS)
    # Cut inside the model field: only its start waits for the next read.
    at = raw.index(SERVED, first) + 5
    out = c.take(raw[first:at])
    assert out == raw[first : at - 5]
    assert c.take(raw[at:]).startswith(ALIAS)


def test_partial_tail_finds_only_an_unfinished_field() -> None:
    assert partial_tail(b'data: {"id":"c1","mod', SERVED) == 4
    assert partial_tail(b'data: {"id":"c1","model":"m-v', SERVED) == len(b'"model":"m-v')
    assert partial_tail(b'{"model":"m-v2"}\n\n', SERVED) == 0
    assert partial_tail(b'{"id":"c1"', SERVED) == 1  # a quote could begin it
    assert partial_tail(b"", SERVED) == 0
