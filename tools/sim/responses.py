"""Response bodies and SSE events in vLLM 0.32's shapes. Pure: values in, bytes out.

Every API that streams tokens gives its events as a ``StreamFormat`` (``serving.py`` runs
them): its opening events, sent with the first token; one token's events; the closing ones
after the last token; and what it sends when the engine fails mid-stream. ``ChunkStream``
is the completions' and chat's: ``data:`` chunks ending with ``[DONE]``.
"""

from __future__ import annotations

import json
from typing import Any, Final, Protocol

from tools.sim.engine import TokenEvent
from tools.sim.protocol import Outcome, error_envelope
from tools.sim.tokens import OutputText

DONE: Final = b"data: [DONE]\n\n"


def dumps(obj: Any) -> str:
    """Compact JSON, as vLLM's (Starlette's) responses are."""
    return json.dumps(obj, separators=(",", ":"))


def sse(payload: dict[str, Any]) -> bytes:
    """One SSE event, serialised once."""
    return b"data: " + dumps(payload).encode() + b"\n\n"


def named_event(kind: str, payload: dict[str, Any]) -> bytes:
    """One named SSE event (``event: <kind>`` then ``data: <json>``), as the Responses and
    Messages APIs write them."""
    return f"event: {kind}\ndata: {dumps(payload)}\n\n".encode()


def error_event(envelope: dict[str, Any]) -> bytes:
    """vLLM's mid-stream error event: the error envelope, serialised with ``json.dumps``'
    default separators (vLLM builds it apart from its other events)."""
    return b"data: " + json.dumps(envelope).encode() + b"\n\n"


# What vLLM sends when the engine fails a request mid-stream (its GenerationError).
ENGINE_ERROR: Final = error_event(error_envelope(500, "Internal server error"))


class StreamFormat(Protocol):
    """One streaming request's events, as its API writes them."""

    def opening(self) -> list[bytes]:
        """Sent with the first token (nothing before it: a stream whose engine hangs or
        fails first sends none of them)."""
        ...

    def token(self, event: TokenEvent) -> bytes:
        """One token's events (maybe none)."""
        ...

    def closing(self, end: Outcome) -> list[bytes]:
        """After the last token."""
        ...

    def failure(self) -> list[bytes]:
        """The engine failed the request mid-stream (the ``error_after_tokens`` fault)."""
        ...


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


class ResponseFormat:
    """Builds every body of one request: stream chunks or the whole response."""

    __slots__ = ("chat", "created", "id", "model", "prompt_tokens")

    def __init__(
        self, *, chat: bool, response_id: str, created: int, model: str, prompt_tokens: int
    ) -> None:
        self.chat = chat
        self.id = response_id
        self.created = created
        self.model = model
        self.prompt_tokens = prompt_tokens

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
        }

    def role_chunk(self) -> bytes:
        """The chat stream's first event: the assistant role with empty content."""
        chunk = self._head()
        chunk["choices"] = [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        return sse(chunk)

    def token_chunk(
        self,
        text: str,
        finish_reason: str | None,
        completion_tokens: int | None = None,
        stop_reason: str | None = None,
    ) -> bytes:
        """One token's event; ``completion_tokens`` adds usage (continuous_usage_stats);
        the last one's ``stop_reason`` is the stop string that ended the answer, if any."""
        chunk = self._head()
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        if finish_reason is not None or not self.chat:
            choice["stop_reason"] = stop_reason
        chunk["choices"] = [choice]
        if completion_tokens is not None:
            chunk["usage"] = usage(self.prompt_tokens, completion_tokens)
        return sse(chunk)

    def usage_chunk(self, completion_tokens: int, details: dict[str, Any] | None = None) -> bytes:
        """The ``include_usage`` event: no choices, usage only (``details``: the prompt's
        ``prompt_tokens_details``, when reported)."""
        chunk = self._head()
        chunk["choices"] = []
        chunk["usage"] = usage(self.prompt_tokens, completion_tokens)
        if details is not None:
            chunk["usage"]["prompt_tokens_details"] = details
        return sse(chunk)

    def full(
        self,
        text: str,
        finish_reason: str,
        completion_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
        *,
        stop_reason: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The non-streaming response (a prefill instance's carries ``kv_transfer_params``;
        ``stop_reason`` is the stop string that ended it, ``details`` the prompt's
        ``prompt_tokens_details`` when reported)."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [],
                "reasoning_content": None,
            }
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = stop_reason
        if not self.chat:
            choice["prompt_logprobs"] = None
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {
                **usage(self.prompt_tokens, completion_tokens),
                "prompt_tokens_details": details,
            },
            "prompt_logprobs": None,
            "kv_transfer_params": kv_transfer_params,
        }


class ChunkStream:
    """A completions or chat stream (``StreamFormat``): the role chunk (chat), a chunk per
    token, the ``include_usage`` chunk and ``[DONE]``; vLLM's error event then ``[DONE]``
    when the engine fails."""

    __slots__ = ("continuous", "details", "fmt", "include_usage", "output")

    def __init__(
        self,
        fmt: ResponseFormat,
        output: OutputText,
        *,
        include_usage: bool,
        continuous: bool,
        details: bool,
    ) -> None:
        self.fmt = fmt
        self.output = output
        self.include_usage = include_usage
        self.continuous = continuous
        self.details = details  # --enable-prompt-tokens-details

    def opening(self) -> list[bytes]:
        return [self.fmt.role_chunk()] if self.fmt.chat else []

    def token(self, event: TokenEvent) -> bytes:
        index = event.index
        last = event.finish_reason is not None
        return self.fmt.token_chunk(
            self.output.piece(index),
            event.finish_reason,
            index + 1 if self.continuous else None,
            self.output.stop_reason if last else None,
        )

    def closing(self, end: Outcome) -> list[bytes]:
        parts = []
        if end.finish_reason == "abort":  # vLLM's terminal output: no token, the reason
            parts.append(self.fmt.token_chunk("", "abort"))
        if self.include_usage:
            details = None
            if self.details:
                details = end.prompt_details(created=self.fmt.chat, whole=False)
            parts.append(self.fmt.usage_chunk(end.tokens, details))
        parts.append(DONE)
        return parts

    def failure(self) -> list[bytes]:
        return [ENGINE_ERROR, DONE]
