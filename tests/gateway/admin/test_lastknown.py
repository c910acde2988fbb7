"""The fleet's views answered from the last state known (``gateway.admin.lastknown``)."""

from __future__ import annotations

from typing import Any

from structlog.testing import capture_logs

from gateway.admin.lastknown import LastKnown, ViewUnavailable


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def ok(doc: dict[str, Any]) -> dict[str, Any]:
    return doc


async def down() -> dict[str, Any]:
    raise ConnectionError("Connection refused")


async def unreadable() -> dict[str, Any]:
    raise ViewUnavailable("the budgets' counts cannot be read")


async def test_a_failed_read_answers_the_last_document_marked_with_its_age() -> None:
    clock = Clock()
    views = LastKnown(0.5, clock=clock)
    assert await views.read("replicas", lambda: ok({"n": 1}), lambda: {"n": 0}) == {"n": 1}
    clock.now += 12.5
    doc = await views.read("replicas", down, lambda: {"n": 0})
    assert doc == {"n": 1, "stale": {"age_s": 12.5, "why": "Connection refused"}}
    never = await views.read("keys", down, lambda: {"keys": []})
    assert never == {"keys": [], "stale": {"age_s": None, "why": "Connection refused"}}


async def test_one_line_an_outage_however_many_views_and_causes() -> None:
    """Redis down, then back but the budgets unreadable while the log heals: the replicas view
    is fresh again before the keys view is: still one outage, one line each way."""
    clock = Clock()
    views = LastKnown(0.5, clock=clock)
    with capture_logs() as logs:
        for _ in range(3):
            await views.read("replicas", down, lambda: {})
            await views.read("keys", down, lambda: {})
        await views.read("replicas", lambda: ok({}), lambda: {})
        await views.read("keys", unreadable, lambda: {})
        await views.read("keys", lambda: ok({}), lambda: {})
        await views.read("keys", down, lambda: {})  # the next outage
    assert [e["event"] for e in logs] == [
        "admin_views_stale",
        "admin_views_fresh",
        "admin_views_stale",
    ]


async def test_a_view_not_read_again_ends_no_outage_forever() -> None:
    clock = Clock()
    views = LastKnown(0.5, clock=clock)
    with capture_logs() as logs:
        await views.read("usage:a:31", down, lambda: {})  # never read again
        clock.now += 121
        await views.read("replicas", lambda: ok({}), lambda: {})
    assert [e["event"] for e in logs] == ["admin_views_stale", "admin_views_fresh"]
