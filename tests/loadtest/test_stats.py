"""Statistics on fixed inputs: percentiles, ITL extraction, goodput, throughput, timeline."""

from __future__ import annotations

import math

import pytest

from loadtest.stats import (
    Dist,
    RequestRecord,
    Slo,
    loop_lag_warning,
    percentile,
    summarize,
    timeline,
    timings_from_stream,
)


def chat(content: str) -> bytes:
    return (
        b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"'
        + content.encode()
        + b'"},"finish_reason":null}]}\n\n'
    )


ROLE = (
    b'data: {"object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
)
USAGE = (
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}\n\n'
)
DONE = b"data: [DONE]\n\n"


def test_percentile_interpolates_linearly_like_numpy() -> None:
    v = [1.0, 2.0, 3.0, 4.0]
    assert percentile(v, 0) == 1.0
    assert percentile(v, 50) == 2.5
    assert percentile(v, 90) == pytest.approx(3.7)
    assert percentile(v, 99) == pytest.approx(3.97)
    assert percentile(v, 100) == 4.0
    assert percentile([7.0], 99) == 7.0


def test_percentile_of_nothing_is_nan_and_rejects_bad_p() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match=r"within 0\.\.100"):
        percentile([1.0], 101)


def test_dist_summarises_unsorted_values() -> None:
    d = Dist.of([0.4, 0.1, 0.3, 0.2])
    assert (d.n, d.p50, d.max) == (4, pytest.approx(0.25), 0.4)
    assert d.mean == pytest.approx(0.25)
    assert d.to_json_ms()["p50"] == 250.0
    assert Dist.of([]).to_json_ms()["p99"] is None


def test_itl_extraction_from_a_recorded_chat_stream() -> None:
    """Role chunk is not a token; events in one read give a 0 gap; split events count once."""
    second, third = chat(" world"), chat("!")
    split = chat(" again")
    reads = [
        (0.10, ROLE),
        (0.15, chat("Hello")),
        (0.20, second + third),  # two events in one read
        (0.28, split[:20]),
        (0.31, split[20:] + USAGE),
        (0.32, DONE),
    ]
    t = timings_from_stream(0.0, reads)
    assert t.ttft == pytest.approx(0.15)
    assert t.itls == pytest.approx((0.05, 0.0, 0.11))
    assert t.content_events == 4
    assert t.usage_tokens == 4
    assert t.done
    assert t.error is None


def test_itl_extraction_from_a_completions_stream_with_crlf() -> None:
    ev = b'data: {"object":"text_completion","choices":[{"index":0,"text":"%s"}]}\r\n\r\n'
    reads = [(1.0, ev % b"a"), (1.5, ev % b""), (2.0, ev % b"b"), (2.1, b"data: [DONE]\r\n\r\n")]
    t = timings_from_stream(0.5, reads)
    assert t.ttft == pytest.approx(0.5)
    assert t.itls == pytest.approx((1.0,))  # the empty-text event is not a token
    assert t.done


def test_an_error_event_inside_the_stream_is_reported() -> None:
    err = b'data: {"error":{"message":"backend b1: connection lost","type":"x"}}\n\n'
    t = timings_from_stream(0.0, [(0.1, chat("a")), (0.2, err + DONE)])
    assert t.error == "backend b1: connection lost"
    assert t.content_events == 1


def rec(start: float, ttft: float, tokens: int, gap: float, **kw: object) -> RequestRecord:
    itls = (gap,) * (tokens - 1)
    return RequestRecord(
        start=start,
        ttft=ttft,
        itls=itls,
        e2e=ttft + gap * (tokens - 1),
        tokens_out=tokens,
        status=200,
        **kw,  # type: ignore[arg-type]
    )


def test_tpot_is_time_after_the_first_token_per_remaining_token() -> None:
    r = rec(0.0, 0.2, 5, 0.05)
    assert r.tpot == pytest.approx(0.05)
    assert rec(0.0, 0.2, 1, 0.05).tpot is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = [
        rec(0.0, 0.1, 11, 0.02),  # good
        rec(0.0, 0.6, 11, 0.02),  # TTFT too slow
        rec(0.0, 0.1, 11, 0.08),  # TPOT too slow
        RequestRecord(start=0.5, e2e=0.01, status=503, error="http_503"),  # failed
        rec(-1.0, 9.0, 11, 0.5, warmup=True),  # warm-up: not counted at all
    ]
    s = summarize(records, Slo(ttft=0.5, itl=0.05))
    assert s.requests == 4
    assert s.ok == 3
    assert s.errors == {"http_503": 1}
    assert s.goodput_share == pytest.approx(1 / 4)
    assert s.goodput_rps == pytest.approx(1 / s.window)


def test_throughput_is_over_the_measured_window() -> None:
    records = [rec(0.0, 0.1, 10, 0.1), rec(1.0, 0.1, 10, 0.1)]  # ends at 1.0 and 2.0
    s = summarize(records)
    assert s.window == pytest.approx(2.0)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(10.0)
    assert s.ttft.p50 == pytest.approx(0.1)
    assert s.itl.n == 18
    assert s.goodput_share is None  # no SLO given


def test_timeline_puts_tokens_where_they_arrived() -> None:
    records = [rec(0.0, 0.5, 3, 0.5), rec(1.2, 0.1, 1, 0.0, error=None)]
    b = timeline(records, width=1.0)
    assert [x.started for x in b] == [1, 1]
    assert [x.tokens for x in b] == [1, 3]  # 0.5 | 1.0, 1.3, 1.5
    assert [x.completed for x in b] == [0, 2]
    assert b[0].ttft_p50 == pytest.approx(0.5)


def test_loop_lag_warning_only_when_lag_matters() -> None:
    ttft = Dist.of([0.2])
    assert loop_lag_warning(Dist.of([0.0005] * 100), ttft) is None
    warning = loop_lag_warning(Dist.of([0.02] * 100), ttft)
    assert warning is not None
    assert "lag p99 20.0 ms" in warning
    cpu = loop_lag_warning(Dist.of([0.0]), ttft, client_cpu_share=0.95)
    assert cpu is not None
    assert "95%" in cpu
