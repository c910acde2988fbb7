"""Response heads as bytes (``gateway.http.head``): status lines, header fields, ``Date``."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from gateway.http.head import HttpDate, header_block, status_line


def test_status_lines_with_their_standard_phrase_or_the_one_given() -> None:
    assert status_line(200) == b"HTTP/1.1 200 OK\r\n"
    assert status_line(431) == b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    assert status_line(599) == b"HTTP/1.1 599 \r\n"
    assert status_line(200, "Fine") == b"HTTP/1.1 200 Fine\r\n"


@pytest.mark.parametrize(
    ("status", "reason", "match"),
    [
        (99, None, "not an HTTP status"),
        (1000, None, "not an HTTP status"),
        (200, "a\r\nX: y", "line"),
    ],
)
def test_a_bad_status_or_reason_is_refused(status: int, reason: str | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        status_line(status, reason)


def test_header_fields_in_order_repeats_kept() -> None:
    headers = CIMultiDict([("A", "1"), ("Set-Cookie", "x"), ("Set-Cookie", "y")])
    assert header_block(headers) == b"A: 1\r\nSet-Cookie: x\r\nSet-Cookie: y\r\n"
    assert header_block(CIMultiDict()) == b""


@pytest.mark.parametrize(
    "field", [("X", "a\r\nInjected: 1"), ("X", "a\nb"), ("X", "a\rb"), ("X\r\nY", "a")]
)
def test_a_line_break_in_a_field_is_refused(field: tuple[str, str]) -> None:
    with pytest.raises(ValueError, match="line break"):
        header_block(CIMultiDict([("Ok", "1"), field]))


def test_the_date_is_formatted_once_a_second() -> None:
    now = [784111777.0]
    date = HttpDate(clock=lambda: now[0])
    first = date()
    assert first == b"Date: Sun, 06 Nov 1994 08:49:37 GMT\r\n"
    now[0] += 0.5
    assert date() is first  # the same second: the same bytes, not formatted again
    now[0] += 0.5
    assert date() == b"Date: Sun, 06 Nov 1994 08:49:38 GMT\r\n"
