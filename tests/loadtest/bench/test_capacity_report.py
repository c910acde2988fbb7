"""A compressed day's figures from its samples and requests, and its JSON read back whole."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loadtest.bench.capacity_report import REQUEST_COLUMNS, Sent, dump, figures, rows


def sample(t: float, awake: int, *, gateway: int | None = None, moving: int = 0) -> dict[str, Any]:
    return {
        "t": t,
        "awake": awake,
        "moving": moving,
        "gateway": {"awake": awake if gateway is None else gateway},
    }


def test_figures_count_engine_seconds_windows_and_failures_of_the_day_alone() -> None:
    samples = [sample(-5, 4), sample(0, 1), sample(10, 2, gateway=1, moving=1), sample(20, 1)]
    requests = [
        Sent(at=-3, ttft=9.0),  # the warm-up: left out
        Sent(at=1, ttft=0.1, status=200),
        Sent(at=2, ttft=0.3, status=200),
        Sent(at=12, status=503, error="http_503"),
        Sent(at=25, ttft=2.0, status=200),
    ]
    f = figures(samples, requests, width=10, end=30, engines=4, slo=1.0)
    assert f["always_on_engine_s"] == 120
    assert f["awake_engine_s"] == 10 + 20 + 10
    assert f["awake_share"] == pytest.approx(40 / 120, abs=1e-4)
    assert f["awake_engine_s_gateway"] == 30
    assert f["awake_or_moving_engine_s"] == 10 + 30 + 10
    assert (f["requests"], f["failed"], f["errors"]) == (4, 1, {"http_503": 1})
    assert [w["sent"] for w in f["windows"]] == [2, 1, 1]
    assert f["windows_over_slo"] == 1  # the last: 2 s
    assert f["worst_window_p99"] == 2.0


def test_the_json_reads_back_as_the_result() -> None:
    result = {
        "case": "managed",
        "rule": {"per_engine": 10.0},
        "samples": [sample(0, 1), sample(1, 2)],
        "events": [{"event": "capacity_waking", "why": "a, b"}],
        "requests": {
            "columns": list(REQUEST_COLUMNS),
            "rows": rows([Sent(at=1.23456, ttft=0.05, status=200), Sent(at=0.5)]),
        },
    }
    text = dump(result)
    assert json.loads(text) == result
    assert result["requests"]["rows"][0] == [0.5, None, None, 0, None, 0]  # by send time
    assert result["requests"]["rows"][1][0] == 1.2346
    lines = text.splitlines()  # a sample, a row, a log line a line
    assert '  {"t":1,"awake":2,"moving":0,"gateway":{"awake":2}}' in lines
    assert '  {"event":"capacity_waking","why":"a, b"}' in lines
    assert "   [1.2346,0.05,null,200,null,0]" in lines
