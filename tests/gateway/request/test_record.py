"""How a request ended is said once, by ``finish``, from what ended it (``conclude``): the
answer's own ending as its relay saw it, or the exception that ended the request."""

from __future__ import annotations

import asyncio

import pytest

from backends.errors import GatewayError, NoBackendAvailable, RateLimited, UpstreamTimeout
from gateway.request.record import Ending, RequestOutcome, RequestRecord, conclude


def _record(status: int = 0) -> RequestRecord:
    record = RequestRecord("rid", started=0.0)
    record.status = status
    return record


@pytest.mark.parametrize(
    ("outcome", "status_before", "ending", "status"),
    [
        (Ending.COMPLETE, 200, "complete", 200),
        (Ending.UPSTREAM_ERROR, 200, "upstream_error", 200),  # the head had said 200
        (Ending.CLIENT_DISCONNECT, 200, "client_disconnect", 200),
        (NoBackendAvailable("none", retry_after=1), 0, "NoBackendAvailable", 503),
        (RateLimited("slow down", limit_type="requests"), 0, "RateLimited", 429),
        (UpstreamTimeout("late"), 0, "UpstreamTimeout", 504),
        (asyncio.CancelledError(), 0, "client_disconnect", 0),  # queued, or before the head
        (asyncio.CancelledError(), 200, "client_disconnect", 200),  # mid-stream
        (RuntimeError("a bug"), 0, "internal_error", 500),
        (KeyboardInterrupt(), 0, "internal_error", 500),
    ],
)
def test_every_way_a_request_ends_is_named(
    outcome: RequestOutcome, status_before: int, ending: str, status: int
) -> None:
    record = _record(status_before)
    assert conclude(record, outcome, lambda: "client_disconnect") == ending
    assert (record.ending, record.status) == (ending, status)


def test_a_cancellation_while_the_gateway_stops_says_so() -> None:
    record = _record()
    assert conclude(record, asyncio.CancelledError(), lambda: "shutdown") == "shutdown"


def test_a_gateway_error_keeps_its_own_status() -> None:
    class Teapot(GatewayError):
        status = 418

    record = _record(200)
    conclude(record, Teapot("no"), lambda: "client_disconnect")
    assert (record.ending, record.status) == ("Teapot", 418)
