"""A response's head as bytes: the status line, the header fields, the ``Date`` field.

Pure: no I/O. The connection (``gateway.http.protocol``) adds what only it knows (``Date``,
``Connection: close``, the blank line) when the head goes out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Final

from multidict import CIMultiDict

_PHRASES: Final = {s.value: s.phrase for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}  # a memo of the lines for 100..999, built as they are used


def status_line(status: int, reason: str | None = None) -> bytes:
    """``HTTP/1.1 <status> <reason>\\r\\n``; the standard phrase unless ``reason`` is given."""
    if not 100 <= status <= 999:
        raise ValueError(f"not an HTTP status: {status}")
    if reason is None:
        line = _STATUS_LINES.get(status)
        if line is None:
            line = f"HTTP/1.1 {status} {_PHRASES.get(status, '')}\r\n".encode()
            _STATUS_LINES[status] = line
        return line
    if "\r" in reason or "\n" in reason:
        raise ValueError("a line break in the reason phrase")
    return f"HTTP/1.1 {status} {reason}\r\n".encode()


def phrase(status: int) -> str:
    return _PHRASES.get(status, "")


def header_block(headers: CIMultiDict[str]) -> bytes:
    """The header fields, one ``name: value\\r\\n`` line each; ``ValueError`` if a name or
    value holds a line break (which would let it write fields, or a body, of its own)."""
    if not headers:
        return b""
    text = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    n = len(headers)
    if text.count("\n") != n or text.count("\r") != n:
        raise ValueError("a line break in a header field's name or value")
    return text.encode("utf-8")


class HttpDate:
    """The ``Date`` field line, formatted at most once a second (``clock``: wall time)."""

    __slots__ = ("_clock", "_line", "_second")

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._second = -1
        self._line = b""

    def __call__(self) -> bytes:
        second = int(self._clock())
        if second != self._second:
            self._second = second
            self._line = b"Date: %s\r\n" % formatdate(second, usegmt=True).encode()
        return self._line
