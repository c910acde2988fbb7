"""The overload bench's figures (``loadtest.overload``): pure functions on made-up records."""

from __future__ import annotations

import math

import pytest

from loadtest.overload import (
    Attempt,
    Request,
    budget_table,
    budget_windows,
    capacity,
    class_figures,
    class_table,
    classify,
    timeline,
)


def _ok(sent: float, ttft: float, ended: float) -> Attempt:
    return Attempt(sent=sent, status=200, ttft=ttft, ended=ended, content=5, outcome="ok")


def _refused(sent: float, retry_after: float, code: str = "shed_by_priority") -> Attempt:
    return Attempt(sent=sent, status=429, code=code, retry_after=retry_after, outcome="refused")


def _timed_out(sent: float, ended: float) -> Attempt:
    a = _refused(sent, 1, "queue_timeout")
    a.status, a.ended = 503, ended
    return a


def test_an_answer_is_ok_only_with_done_and_no_error_event() -> None:
    assert classify(200, retry_after=None, done=True, stream_error=False, content=3) == "ok"
    assert classify(200, retry_after=None, done=False, stream_error=False, content=3) == "broken"
    assert classify(200, retry_after=None, done=True, stream_error=True, content=3) == "broken"
    assert classify(200, retry_after=None, done=False, stream_error=False, content=0) == "error"


def test_a_connection_lost_after_content_is_a_stream_broken_mid_way() -> None:
    got = classify(200, retry_after=None, done=False, stream_error=False, content=4, failed=True)
    assert got == "broken"
    assert classify(
        0, retry_after=None, done=False, stream_error=False, content=0, failed=True
    ) == ("error")


def test_429_and_503_are_refusals_only_with_retry_after() -> None:
    assert classify(429, retry_after=3, done=False, stream_error=False, content=0) == "refused"
    assert classify(503, retry_after=1, done=False, stream_error=False, content=0) == "refused"
    assert classify(429, retry_after=None, done=False, stream_error=False, content=0) == "error"
    assert classify(502, retry_after=1, done=False, stream_error=False, content=0) == "error"


def test_capacity_is_the_last_rate_within_the_factor_of_the_idle_p99() -> None:
    levels = [(2.0, 0.10), (6.0, 0.12), (9.0, 0.19), (11.0, 0.25), (13.0, 0.31)]
    assert capacity(levels, factor=2.0) == 9.0


def test_capacity_takes_one_level_over_then_one_within_for_noise() -> None:
    levels = [(2.0, 0.10), (6.0, 0.12), (9.0, 0.35), (11.0, 0.15), (13.0, 0.5), (15.0, 0.7)]
    assert capacity(levels, factor=2.0) == 11.0
    assert capacity([(2.0, 0.1), (6.0, 0.15), (9.0, 0.5)], factor=2.0) == 6.0  # the last: over


def test_capacity_counts_a_level_with_no_answer_as_over() -> None:
    assert capacity([(2.0, 0.1), (6.0, math.nan), (9.0, math.nan)], factor=2.0) == 2.0
    with pytest.raises(ValueError, match="no levels"):
        capacity([])


def test_class_figures_follow_each_request_through_its_refusals() -> None:
    reqs = [
        Request("batch", 1.0, [_refused(1.0, 5), _refused(6.1, 2), _ok(8.2, 0.3, 9.0)]),
        Request("batch", 0.5, [_timed_out(0.5, 20.5)], gave_up=True),
        Request("interactive", 3.0, [_ok(3.0, 0.1, 4.0)]),
        Request("interactive", -1.0, [_ok(-1.0, 0.1, 0.0)]),  # before ``since``: not counted
    ]
    figs = class_figures(reqs, ["interactive", "batch"], since=0.0)
    batch, inter = figs["batch"], figs["interactive"]
    assert batch["requests"] == 2
    assert batch["ok"] == 1
    assert batch["gave_up"] == 1
    assert batch["errors"] == 0
    assert batch["attempts"] == 4
    assert batch["refused"] == 3
    assert batch["refused_by_code"] == {"shed_by_priority": 2, "queue_timeout": 1}
    assert batch["requests_refused"] == 2
    assert batch["retry_after_s"]["values"] == {1: 1, 2: 1, 5: 1}
    assert batch["first_refused_at_s"] == 1.0  # when it came: the one sent first waited
    assert batch["ttft_ms"]["p50"] == 300.0  # from the answered attempt's send
    assert batch["user_ttft_ms"]["p50"] == 7500.0  # 8.2 + 0.3 - 1.0: the waits included
    assert inter["requests"] == 1
    assert inter["refused"] == 0
    assert inter["first_refused_at_s"] is None


def test_class_figures_count_broken_streams_and_errors() -> None:
    broken = Attempt(sent=1.0, status=200, content=7, outcome="broken", error="no_done")
    failed = Attempt(sent=2.0, status=502, outcome="error", error="http_502")
    figs = class_figures([Request("standard", 1.0, [broken]), Request("standard", 2.0, [failed])],
                         ["standard"])  # fmt: skip
    f = figs["standard"]
    assert f["errors"] == 2
    assert f["broken_mid_stream"] == 1
    assert f["error_kinds"] == {"broken:no_done": 1, "error:http_502": 1}
    assert f["ttft_ms"]["p99"] is None


def test_timeline_buckets_sends_by_send_time_and_refusals_by_when_they_came() -> None:
    reqs = [
        Request("batch", 0.5, [_timed_out(0.5, 7.0), _ok(8.1, 0.2, 9.0)]),
        Request("batch", 1.0, [_ok(1.0, 0.4, 2.0)]),
        Request("batch", 2.0, [_refused(2.0, 5)]),  # answered at once (no end: its send)
    ]
    windows = timeline(reqs, ["batch"], width=5.0, start=0.0, end=10.0)["batch"]
    assert [w["t"] for w in windows] == [0.0, 5.0]
    assert [w["sent"] for w in windows] == [3, 1]
    assert [w["refused_429"] for w in windows] == [1, 0]
    assert [w["refused_503"] for w in windows] == [0, 1]
    assert windows[0]["ttft_p99_ms"] == 400.0
    assert windows[1]["ttft_p99_ms"] == 200.0


def test_budget_windows_compare_extra_attempts_with_what_the_budget_allows() -> None:
    # The engines received 10 a second; the gateway let 8 a second through (2 extra each).
    counts = [(float(t), 10.0 * t, 8.0 * t) for t in range(13)]
    windows = budget_windows(counts, ratio=0.2, min_per_second=5.0, window=10.0)
    assert [w["t"] for w in windows] == [10.0, 11.0, 12.0]
    first = windows[0]
    assert first["received"] == 100.0
    assert first["requests"] == 80.0
    assert first["extra"] == 20.0
    assert first["allowed"] == pytest.approx(0.2 * 80 + 5.0 * 10)


def test_the_tables_show_each_class_and_the_budgets_worst_window() -> None:
    reqs = [Request("batch", 1.0, [_refused(1.0, 5), _ok(6.1, 0.3, 7.0)])]
    windows = [
        {"t": 10.0, "received": 60.0, "requests": 50.0, "extra": 10.0, "allowed": 60.0},
        {"t": 11.0, "received": 50.0, "requests": 48.0, "extra": 2.0, "allowed": 59.6},
    ]
    res = {
        "case": "killed",
        "figures": class_figures(reqs, ["batch"]),
        "final": {
            "budget": {"retry_taken": 2.0, "continuation_taken": 8.0, "retry_refused": 1.0},
            "admission": {"admitted_at_once": 10.0, "admitted_after_wait": 40.0},
        },
        "budget_windows": windows,
        "samples": [{"engines": {"e0": {"received": 31.0}, "e1": {"received": 29.0}}}],
        "budget_use_max": 0.25,
    }
    assert "| killed | batch | 1 | 1 | 0 | 0 | shed_by_priority: 1 | 5 / 5 | 300 / 300 |" in (
        class_table([res])
    )
    assert (
        budget_table([res]).splitlines()[-1]
        == "| killed | 50 | 2 / - / 8 | 1 | 60 | 10 (60) | 25% |"
    )
