"""What the server answers itself, before any handler: a request it will not take.

A ``Refused`` carries the status and why (the reason becomes both the error body's message
and the ``http_refused`` log line's field); ``parser_refusal`` turns llhttp's complaints into
one. Its status names the error body's ``code`` (``refusal_code``). Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Final

import httptools

from backends.errors import error_envelope

# The error body's ``code`` of each status the server refuses with: the status's name, as the
# gateway's other codes of HTTP's own statuses (``request_too_large``, ``request_timeout`` of
# ``backends.errors``); a 400 here is always the HTTP itself, never its body's content.
CODES: Final[Mapping[int, str]] = {
    400: "malformed_http_request",
    408: "request_timeout",
    414: "uri_too_long",
    417: "expectation_failed",
    431: "request_header_fields_too_large",
    505: "http_version_not_supported",
}


class Refused(Exception):
    """A request refused by the server itself (bad framing, too large, too slow)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def parser_refusal(exc: httptools.HttpParserError) -> Refused:
    """llhttp's error as a 400, with its own words ("Invalid character in Content-Length")."""
    reason = str(exc).strip() or "Malformed request"
    if isinstance(exc, httptools.HttpParserInvalidMethodError):
        reason = "Invalid method"
    return Refused(400, reason)


def refusal_code(status: int) -> str | None:
    """The error body's ``code`` for a refusal with ``status`` (None: a 500, a handler's bug)."""
    return CODES.get(status)


def default_error_body(status: int, message: str, path: str | None) -> bytes:
    """OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}``. Every
    refusal is the client's doing (505 included); a 500 is a handler's bug."""
    kind = "internal_error" if status == 500 else "invalid_request_error"
    envelope = error_envelope(message, kind, code=refusal_code(status))
    return json.dumps(envelope, separators=(",", ":")).encode()
