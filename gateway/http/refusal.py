"""What the server answers itself, before any handler: a request it will not take.

A ``Refused`` carries the status and why (the reason becomes both the error body's message
and the ``http_refused`` log line's field); ``parser_refusal`` turns llhttp's complaints into
one. Pure: no I/O.
"""

from __future__ import annotations

import json

import httptools

from backends.errors import error_envelope


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


def default_error_body(status: int, message: str, path: str | None) -> bytes:
    """OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}``. Every
    refusal is the client's doing (505 included); a 500 is a handler's bug."""
    kind = "internal_error" if status == 500 else "invalid_request_error"
    return json.dumps(error_envelope(message, kind), separators=(",", ":")).encode()
