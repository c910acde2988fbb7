"""Server-sent events, read incrementally. Pure: bytes in, events out.

The relay forwards upstream bytes untouched; this parser only watches them, and only until it
has seen what it looks for (the first generated token), so its cost is paid on the first few
events of a stream and not on the rest.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Final

_MAX_PENDING: Final = 1 << 20  # an event larger than this is not an LLM chunk


class SSEParser:
    """Splits a byte stream into the ``data`` payloads of complete events.

    Handles ``\\n``, ``\\r\\n`` and ``\\r`` line ends, comment lines (``: keep-alive``),
    multi-line data, and any split of the stream across reads.
    """

    __slots__ = ("_buf", "_data", "overflowed")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []
        self.overflowed = False

    def feed(self, chunk: bytes) -> list[bytes]:
        return list(self.events(chunk))

    def events(self, chunk: bytes) -> Iterator[bytes]:
        """The payloads ``chunk`` completes, one at a time: a reader that stops early has the
        rest unparsed (and the parser in no state to be fed again)."""
        buf = self._buf + chunk if self._buf else chunk
        if buf.find(b"\r") >= 0:  # not ``in``: see ``gateway.limits.tokens.UsageFilter.feed``
            # A lone trailing \r may be the first half of \r\n: keep it for the next read.
            keep_cr = buf.endswith(b"\r")
            if keep_cr:
                buf = buf[:-1]
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if keep_cr:
                buf += b"\r"
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if not line:
                if self._data:
                    data, self._data = self._data, []
                    yield b"\n".join(data)
                continue
            if line.startswith(b":"):
                continue
            field, _, value = line.partition(b":")
            if field == b"data":
                self._data.append(value[1:] if value.startswith(b" ") else value)
        self._buf = buf[start:]
        if len(self._buf) + sum(len(d) for d in self._data) > _MAX_PENDING:
            self.overflowed = True
            self._buf = b""
            self._data = []


def carries_token(payload: bytes) -> bool:
    """True if a stream's event carries generated output (text, content or tool call).

    The chat stream's first chunk (``{"role": "assistant", "content": ""}``) does not count,
    nor do a Messages stream's ``message_start`` and ``content_block_start``.
    """
    if payload == b"[DONE]":
        return False
    try:
        doc = json.loads(payload)
    except ValueError:
        return False
    if not isinstance(doc, dict):
        return False
    choices = doc.get("choices")
    if not isinstance(choices, list):
        return _carries_event_token(doc)
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text") or choice.get("token_ids"):  # token ids: /inference/v1/generate
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (
            delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
        ):
            return True
    return False


def _carries_event_token(doc: dict[str, Any]) -> bool:
    """The same for the named-event streams: Anthropic's Messages (a content block's delta:
    text, a tool's input, thinking) and OpenAI's Responses (an output text delta)."""
    kind = doc.get("type")
    if kind == "content_block_delta":
        delta = doc.get("delta")
        return isinstance(delta, dict) and bool(
            delta.get("text") or delta.get("partial_json") or delta.get("thinking")
        )
    return kind == "response.output_text.delta" and bool(doc.get("delta"))


def is_error_event(payload: bytes) -> bool:
    """An error reported inside a 200 stream, as vLLM does after streaming has begun."""
    if not payload.startswith(b"{"):
        return False
    try:
        doc: Any = json.loads(payload)
    except ValueError:
        return False
    return isinstance(doc, dict) and "error" in doc


class FirstTokenWatch:
    """Feeds stream bytes until the first token shows; then costs one attribute check."""

    __slots__ = ("_parser", "seen")

    def __init__(self) -> None:
        self._parser: SSEParser | None = SSEParser()
        self.seen = False

    def feed(self, chunk: bytes) -> bool:
        """True exactly once: on the chunk that completes the first token-carrying event."""
        parser = self._parser
        if parser is None:
            return False
        for payload in parser.events(chunk):  # no further than the first token
            if carries_token(payload):
                self.seen = True
                self._parser = None
                return True
        if parser.overflowed:
            self._parser = None
        return False
