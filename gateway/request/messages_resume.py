"""Continuing an Anthropic Messages stream on another backend. Pure: bytes and JSON.

A Messages stream is named events (``message_start``, ``content_block_start``,
``content_block_delta``... ``message_delta``, ``message_stop``). When it breaks, the rest of
the answer is asked for as vLLM would render it, exactly: the Messages body as a chat
(``gateway.request.messages.chat_view``) with the text already sent as the assistant's final
message, continued (``continue_final_message``), on ``/v1/chat/completions``; that chat stream
is rewritten into the client's events (``MessagesStitch``): the text block goes on (a new one,
at the next index, if the client saw it closed), then one ``message_delta`` with the stop
reason and the usage of the whole answer, and one ``message_stop``.

Not continued where it could not be exact (as for chat): a ``tool_use`` block or thinking under
way (``MessagesProgress.blocker``), a stream that is not a Messages stream as vLLM writes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

from gateway.request.continuation import Progress, failure_of, is_int, resume_body
from gateway.request.messages import chat_view
from gateway.request.sse import SSEParser

CHAT_PATH: Final = "/v1/chat/completions"
_MESSAGE_STOP: Final = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


@dataclass(slots=True)
class MessagesProgress:
    """What a Messages stream's client has received so far.

    ``blocker``: what makes a faithful continuation impossible now (``tool_use``,
    ``thinking``, ``unparsable``); None while one is possible.
    """

    input_tokens: int | None = None  # the prompt's tokens, cached ones included
    text: list[str] = field(default_factory=list)
    events: int = 0  # deltas that carried text (a lower bound on the tokens)
    blocks: int = 0  # content blocks started (the next one's index)
    open_block: int | None = None  # the text block the client has open
    finished: str | None = None  # the stop_reason, once ``message_delta`` said it
    done: bool = False  # message_stop seen
    blocker: str | None = None
    _parser: SSEParser = field(default_factory=SSEParser)

    @property
    def generated(self) -> str:
        return "".join(self.text)

    @property
    def exact_ids(self) -> list[int] | None:
        return None  # a Messages stream carries no token ids

    def feed(self, data: bytes) -> None:
        """Whole events as the client received them."""
        for payload in self._parser.feed(data):
            try:
                doc = json.loads(payload)
            except (ValueError, RecursionError):
                self.blocker = self.blocker or "unparsable"
                continue
            if isinstance(doc, dict):
                self.take(doc)

    def take(self, doc: dict[str, Any]) -> None:
        kind = doc.get("type")
        if kind == "message_start":
            message = doc.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            if isinstance(usage, dict):
                self.input_tokens = _input_tokens(usage)
        elif kind == "content_block_start":
            self.blocks += 1
            block = doc.get("content_block")
            kind_of = block.get("type") if isinstance(block, dict) else None
            if kind_of == "text":
                self.open_block = self.blocks - 1
            else:  # a tool's call or thinking: what follows is not plain text
                self.blocker = self.blocker or str(kind_of)
        elif kind == "content_block_delta":
            delta = doc.get("delta")
            text = delta.get("text") if isinstance(delta, dict) else None
            if isinstance(text, str):
                self.text.append(text)
                self.events += 1
        elif kind == "content_block_stop":
            self.open_block = None
        elif kind == "message_delta":
            delta = doc.get("delta")
            reason = delta.get("stop_reason") if isinstance(delta, dict) else None
            self.finished = reason if isinstance(reason, str) else "end_turn"
        elif kind == "message_stop":
            self.done = True


def _input_tokens(usage: dict[str, Any]) -> int:
    """Anthropic's input tokens leave out the cached ones; the prompt is their sum."""
    return sum(
        usage[k]
        for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        if is_int(usage.get(k))
    )


def messages_refusal(doc: dict[str, Any]) -> str | None:
    """Why a stream of this Messages request could not be continued faithfully (None: it
    can be, unless a tool's call or thinking is under way when it breaks)."""
    if doc.get("stream") is not True:
        return "not_stream"
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        return "prompt"
    config = doc.get("output_config")
    if isinstance(config, dict) and config.get("format") is not None:
        return "structured_output"
    return None


def messages_resume_body(
    doc: dict[str, Any], progress: MessagesProgress, generated: int
) -> dict[str, Any]:
    """The chat request for the rest of a Messages answer, ``generated`` tokens already sent."""
    chat = {**chat_view(doc), "stream": True}
    text = Progress(chat=True)
    text.text = [progress.generated]
    return resume_body(chat, True, text, generated)


def end_of_message() -> bytes:
    """What a Messages stream whose end alone was lost still lacks: its ``message_stop``."""
    return _MESSAGE_STOP


class MessagesStitch:
    """Rewrites a continuation's chat events into the client's Messages stream.

    ``generated``: tokens of the answer already sent. The continuation's text deltas go on in
    the client's text block, and its end (a finish, then usage, then ``[DONE]``) becomes one
    ``message_delta`` (the stop reason, the whole answer's usage) and one ``message_stop``.
    ``cut`` is set (and nothing more passes) at an event saying the engine failed, or at one
    a Messages stream could not carry exactly (a tool call).
    """

    __slots__ = ("_parser", "_stop", "_usage", "cut", "emitted", "generated", "progress")

    def __init__(self, progress: MessagesProgress, generated: int) -> None:
        self.progress = progress
        self.generated = generated
        self._parser = SSEParser()
        self._stop: tuple[str, str | None] | None = None  # stop_reason, stop_sequence
        self._usage: dict[str, Any] | None = None
        self.cut: str | None = None
        self.emitted = 0

    def feed(self, data: bytes) -> bytes:
        if self.cut is not None or self.progress.done:
            return b""
        out: list[bytes] = []
        for payload in self._parser.feed(data):
            out += self._event(payload)
            if self.cut is not None:
                break
        self.emitted += len(out)
        return b"".join(out)

    def _event(self, payload: bytes) -> list[bytes]:
        if payload == b"[DONE]":
            return self._end()
        try:
            doc = json.loads(payload)
        except (ValueError, RecursionError):
            return []
        failure = failure_of(doc)
        if failure is not None:
            self.cut = failure
            return []
        if not isinstance(doc, dict):
            return []
        if isinstance(doc.get("usage"), dict):
            self._usage = doc["usage"]
        out: list[bytes] = []
        choices = doc.get("choices")
        for c in choices if isinstance(choices, list) else ():
            if not isinstance(c, dict) or c.get("index", 0) != 0:
                continue
            delta = c.get("delta")
            if isinstance(delta, dict):
                if delta.get("tool_calls") or delta.get("reasoning"):
                    self.cut = "the continuation called a tool or reasoned: not a text block"
                    return out
                content = delta.get("content")
                if isinstance(content, str) and content:
                    out += self._text(content)
            reason = c.get("finish_reason")
            if isinstance(reason, str):
                self._stop = _stop_reason(reason, c.get("stop_reason"))
        return out

    def _text(self, text: str) -> list[bytes]:
        p = self.progress
        out = []
        if p.open_block is None:
            out.append(
                _event(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": p.blocks,
                        "content_block": {"type": "text", "text": ""},
                    },
                )
            )
            p.take({"type": "content_block_start", "content_block": {"type": "text"}})
        delta = {
            "type": "content_block_delta",
            "index": p.open_block,
            "delta": {"type": "text_delta", "text": text},
        }
        p.take(delta)
        out.append(_event("content_block_delta", delta))
        return out

    def _end(self) -> list[bytes]:
        p = self.progress
        out = []
        if p.open_block is not None:
            stop = {"type": "content_block_stop", "index": p.open_block}
            out.append(_event("content_block_stop", stop))
            p.take(stop)
        reason, sequence = self._stop or ("end_turn", None)
        completion = self._usage.get("completion_tokens") if self._usage else None
        usage = {
            "input_tokens": p.input_tokens or 0,
            "output_tokens": self.generated + (completion if is_int(completion) else 0),
        }
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage,
        }
        out.append(_event("message_delta", delta))
        p.take(delta)
        out.append(_MESSAGE_STOP)
        p.done = True
        return out


def _stop_reason(finish: str, stop: Any) -> tuple[str, str | None]:
    """A chat finish as a Messages ``stop_reason`` (and ``stop_sequence``), as vLLM maps it."""
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish == "tool_calls":
        return "tool_use", None
    return "end_turn", None


def _event(name: str, doc: dict[str, Any]) -> bytes:
    return (
        b"event: "
        + name.encode()
        + b"\ndata: "
        + json.dumps(doc, separators=(",", ":")).encode()
        + b"\n\n"
    )
