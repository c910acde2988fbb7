"""Response bodies and SSE events in vLLM 0.32's shapes. Pure: values in, bytes out."""

from __future__ import annotations

import json
from typing import Any, Final

DONE: Final = b"data: [DONE]\n\n"


def dumps(obj: Any) -> str:
    """Compact JSON, as vLLM's (Starlette's) responses are."""
    return json.dumps(obj, separators=(",", ":"))


def sse(payload: dict[str, Any]) -> bytes:
    """One SSE event, serialised once."""
    return b"data: " + dumps(payload).encode() + b"\n\n"


def error_event(envelope: dict[str, Any]) -> bytes:
    """vLLM's mid-stream error event: the error envelope, serialised with ``json.dumps``'
    default separators (vLLM builds it apart from its other events)."""
    return b"data: " + json.dumps(envelope).encode() + b"\n\n"


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
        self, text: str, finish_reason: str | None, completion_tokens: int | None = None
    ) -> bytes:
        """One token's event; ``completion_tokens`` adds usage (continuous_usage_stats)."""
        chunk = self._head()
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        if finish_reason is not None or not self.chat:
            choice["stop_reason"] = None
        chunk["choices"] = [choice]
        if completion_tokens is not None:
            chunk["usage"] = usage(self.prompt_tokens, completion_tokens)
        return sse(chunk)

    def usage_chunk(self, completion_tokens: int) -> bytes:
        """The ``include_usage`` event: no choices, usage only."""
        chunk = self._head()
        chunk["choices"] = []
        chunk["usage"] = usage(self.prompt_tokens, completion_tokens)
        return sse(chunk)

    def full(
        self,
        text: str,
        finish_reason: str,
        completion_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The non-streaming response (a prefill instance's carries ``kv_transfer_params``)."""
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
        choice["stop_reason"] = None
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
                "prompt_tokens_details": None,
            },
            "prompt_logprobs": None,
            "kv_transfer_params": kv_transfer_params,
        }
