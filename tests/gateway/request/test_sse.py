"""The SSE reader and first-token detection, on any split of the stream."""

from __future__ import annotations

import pytest

from gateway.request.sse import FirstTokenWatch, SSEParser, carries_token, is_error_event
from tests.helpers import chat_chunk, sse

ROLE = chat_chunk(role=True)
TOKEN = chat_chunk("Hello")
STREAM = ROLE + b": keep-alive\n\n" + TOKEN + chat_chunk(finish="stop") + b"data: [DONE]\n\n"


def feed_all(parser: SSEParser, parts: list[bytes]) -> list[bytes]:
    out: list[bytes] = []
    for p in parts:
        out.extend(parser.feed(p))
    return out


def test_parser_yields_each_data_payload_and_skips_comments() -> None:
    events = SSEParser().feed(STREAM)
    assert len(events) == 4
    assert events[0] == ROLE[6:-2]
    assert events[-1] == b"[DONE]"


@pytest.mark.parametrize("sep", [b"\n", b"\r\n"])
def test_parser_handles_every_line_ending_and_every_split(sep: bytes) -> None:
    stream = STREAM.replace(b"\n", sep)
    whole = SSEParser().feed(stream)
    assert len(whole) == 4
    for cut in range(1, len(stream)):
        assert feed_all(SSEParser(), [stream[:cut], stream[cut:]]) == whole, cut
    assert feed_all(SSEParser(), [bytes([b]) for b in stream]) == whole


def test_bare_cr_line_ends() -> None:
    stream = STREAM.replace(b"\n", b"\r")
    # A trailing bare CR might be half of CRLF, so the last event waits for the next byte.
    assert len(SSEParser().feed(stream + b"\r")) == 4
    assert len(feed_all(SSEParser(), [stream[:37], stream[37:], b"\n"])) == 4


def test_multi_line_data_is_joined() -> None:
    assert SSEParser().feed(b"data: a\ndata: b\n\n") == [b"a\nb"]


def test_carries_token() -> None:
    assert not carries_token(ROLE[6:-2])
    assert carries_token(TOKEN[6:-2])
    assert carries_token(sse({"choices": [{"index": 0, "text": "x"}]})[6:-2])
    assert not carries_token(sse({"choices": [{"index": 0, "text": ""}]})[6:-2])
    assert carries_token(
        sse({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c"}]}}]})[6:-2]
    )
    assert not carries_token(sse({"choices": [], "usage": {"total_tokens": 3}})[6:-2])
    assert not carries_token(b"[DONE]")
    assert not carries_token(b"{broken")


def test_error_event() -> None:
    assert is_error_event(b'{"error": {"message": "x"}}')
    assert not is_error_event(TOKEN[6:-2])


def test_first_token_watch_fires_once_on_the_chunk_that_completes_the_token_event() -> None:
    for cut in range(1, len(STREAM)):
        w = FirstTokenWatch()
        fired = [w.feed(STREAM[:cut]), w.feed(STREAM[cut:])]
        assert fired.count(True) == 1, cut
        # It fires on the part holding the end of the first token event, not before.
        token_end = len(ROLE) + len(b": keep-alive\n\n") + len(TOKEN)
        assert fired[0] is (cut >= token_end), cut
    w = FirstTokenWatch()
    assert not w.feed(ROLE)
    assert w.feed(TOKEN)
    assert not w.feed(TOKEN)
