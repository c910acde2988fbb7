"""Whose API an endpoint speaks, so whose shapes its clients parse: OpenAI's (``{"error":
{...}}``, a stream ended by ``data: [DONE]``) or Anthropic's (``{"type": "error", "error":
{...}}``, named events ended by ``message_stop``, on ``/v1/messages``). Pure.

Each endpoint of ``gateway.request.endpoints`` names its dialect; the request path asks the
dialect, never which one it is.
"""

from __future__ import annotations

import json
from typing import Final, Literal, Protocol

from backends.errors import UpstreamError, anthropic_envelope, as_anthropic, error_envelope
from gateway.http import refusal_code
from gateway.request.messages_resume import end_of_message

DialectName = Literal["openai", "anthropic"]  # ``GatewayError.shaped``'s names
MESSAGES_PATH: Final = "/v1/messages"
_DONE: Final = b"data: [DONE]\n\n"


class Dialect(Protocol):
    """What differs between the two APIs' shapes."""

    @property
    def name(self) -> DialectName: ...

    @property
    def reshapes_errors(self) -> bool:
        """Whether a backend's error answer is rewritten (``reshaped``) before the client
        gets it (vLLM answers Messages errors in OpenAI's shape)."""
        ...

    def reshaped(self, status: int, body: bytes) -> bytes:
        """A backend's error answer as this dialect's clients parse one."""
        ...

    def error_event(self, err: UpstreamError) -> bytes:
        """How a failure after the stream began reaches the client, and ends its stream."""
        ...

    def stream_end(self) -> bytes:
        """What a stream whose end alone was lost still lacks."""
        ...

    def refusal(self, status: int, message: str) -> bytes:
        """The body of a request the server refused before any handler."""
        ...


class OpenAI:
    name: Final = "openai"
    reshapes_errors: Final = False

    def reshaped(self, status: int, body: bytes) -> bytes:
        return body

    def error_event(self, err: UpstreamError) -> bytes:
        """As vLLM reports one: an ``error`` event, then ``[DONE]``."""
        return b"data: " + _dumps(err.shaped(self.name)) + b"\n\n" + _DONE

    def stream_end(self) -> bytes:
        return _DONE

    def refusal(self, status: int, message: str) -> bytes:
        envelope = error_envelope(message, "invalid_request_error", code=refusal_code(status))
        return json.dumps(envelope).encode()


class Anthropic:
    name: Final = "anthropic"
    reshapes_errors: Final = True

    def reshaped(self, status: int, body: bytes) -> bytes:
        return _dumps(as_anthropic(status, body))

    def error_event(self, err: UpstreamError) -> bytes:
        """As Anthropic's API sends one: a named ``error`` event."""
        return b"event: error\ndata: " + _dumps(err.shaped(self.name)) + b"\n\n"

    def stream_end(self) -> bytes:
        return end_of_message()

    def refusal(self, status: int, message: str) -> bytes:
        return json.dumps(anthropic_envelope(status, message)).encode()


OPENAI: Final = OpenAI()
ANTHROPIC: Final = Anthropic()


def dialect_of(path: str) -> Dialect:
    """Whose shapes a request to ``path`` is answered in (any path, routed or not)."""
    if path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/"):
        return ANTHROPIC
    return OPENAI


def _dumps(doc: object) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()
