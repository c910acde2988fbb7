"""Timing an OpenAI-style SSE stream as the client sees it. Pure: (time, bytes) in, times out.

Definitions are those of vLLM's ``benchmarks/benchmark_serving.py`` (and of
``loadtest/peers/loadgen.py``, so our figures sit beside the peers'):

- a *content event* is a ``data:`` event whose ``text`` (completions) or ``delta.content``
  (chat) is a non-empty string; the chat stream's opening ``{"role": "assistant",
  "content": ""}`` chunk, the usage chunk and ``[DONE]`` are not content;
- every content event is stamped with the time of the socket read that completed it, so
  events that arrive in one read share a timestamp (a 0 ms gap, as in vLLM's client, which
  stamps each chunk as it iterates over what one read returned).

The check is a byte pattern, not a JSON parse: the client must stay cheap at 100k events/s.
Only the rare usage and error events are parsed.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

_CONTENT: Final = re.compile(rb'"(?:text|content)"\s*:\s*"(?!")')
_MAX_PENDING: Final = 1 << 20


class StreamTimer:
    """Feed it each read with its timestamp; it keeps the time of every content event."""

    __slots__ = ("_buf", "done", "error", "overflowed", "token_times", "usage_tokens")

    def __init__(self) -> None:
        self._buf = b""
        self.token_times: list[float] = []
        self.done = False  # saw ``data: [DONE]``
        self.error: str | None = None  # message of an error event inside the stream
        self.usage_tokens: int | None = None  # ``usage.completion_tokens``, when sent
        self.overflowed = False

    def feed(self, now: float, chunk: bytes) -> None:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        if b"\n\n" not in buf:
            self._buf = buf
            if len(buf) > _MAX_PENDING:
                self.overflowed = True
                self._buf = b""
            return
        events = buf.split(b"\n\n")
        self._buf = events.pop()
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._payload(now, line[5:].lstrip())

    def _payload(self, now: float, payload: bytes) -> None:
        if _CONTENT.search(payload):
            self.token_times.append(now)
            if b'"usage":{' not in payload:
                return
        if payload == b"[DONE]":
            self.done = True
            return
        if payload.startswith(b'{"error"') or b'"object":"error"' in payload:
            self.error = _error_message(payload)
            return
        if b'"usage":{' in payload:
            doc = _json(payload)
            usage = doc.get("usage") if doc else None
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                self.usage_tokens = usage["completion_tokens"]


def _json(payload: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(payload)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _error_message(payload: bytes) -> str:
    doc = _json(payload) or {}
    err = doc.get("error", doc)
    if isinstance(err, dict):
        return str(err.get("message") or err.get("type") or "error")
    return str(err)
