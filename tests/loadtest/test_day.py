"""The compressed day (its rate, its seeded arrivals) and the figures drawn from a run of it."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from gateway.capacity.plan import Rule
from gateway.config.settings import load_settings
from loadtest.bench.capacity import DAY, MODEL, RULE, gateway_config
from loadtest.day import Day, compressed_day, integral, windows

DAY_SHAPE = compressed_day(2.0, 16.0, trough_s=100, ramp_s=50, peak_s=100)


def test_a_compressed_day_is_trough_ramp_peak_ramp_trough() -> None:
    d = DAY_SHAPE
    assert d.duration == 400
    assert (d.trough, d.peak) == (2.0, 16.0)
    assert [d.rate(t) for t in (0, 99, 125, 150, 249, 275, 300, 399)] == [2, 2, 9, 16, 16, 9, 2, 2]
    assert d.rate(-5) == 2
    assert d.rate(500) == 2
    assert d.requests() == pytest.approx(2 * 200 + 16 * 100 + 2 * 50 * 9)


def test_the_bench_day_keeps_issue_55s_swing() -> None:
    assert DAY.peak / DAY.trough >= 8


@pytest.mark.parametrize(
    ("points", "why"),
    [
        (((0.0, 1.0),), "two points"),
        (((1.0, 1.0), (2.0, 1.0)), "the first at 0"),
        (((0.0, 1.0), (0.0, 2.0)), "forward in time"),
        (((0.0, 1.0), (5.0, 0.0)), "positive"),
    ],
)
def test_a_day_without_a_start_in_order_or_with_no_rate_is_refused(
    points: tuple[tuple[float, float], ...], why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        Day(points)


def test_arrivals_follow_the_rate_and_repeat_with_their_seed() -> None:
    times = DAY_SHAPE.arrivals(7)
    assert times == DAY_SHAPE.arrivals(7)
    assert times != DAY_SHAPE.arrivals(8)
    assert all(b > a for a, b in itertools.pairwise(times))
    assert times[0] > 0
    assert times[-1] < DAY_SHAPE.duration
    assert len(times) == pytest.approx(DAY_SHAPE.requests(), rel=0.08)
    trough = sum(1 for t in times if t < 100)
    peak = sum(1 for t in times if 150 <= t < 250)
    assert peak / trough == pytest.approx(8, rel=0.25)


def test_arrivals_from_a_later_start() -> None:
    assert min(DAY_SHAPE.arrivals(7, start=300)) > 300


def test_windows_group_requests_by_send_time() -> None:
    requests = [(0.5, 0.1, True), (1.0, 0.3, True), (1.5, None, False), (12.0, 0.2, True)]
    requests += [(-1.0, 9.0, True), (25.0, 9.0, True)]  # outside: left out
    w0, w1, w2 = windows(requests, 10.0, 0.0, 25.0)
    assert (w0.start, w0.end, w0.sent, w0.failed) == (0.0, 10.0, 3, 1)
    assert w0.ttft_p50 == pytest.approx(0.2)
    assert w0.ttft_p99 == pytest.approx(0.298)
    assert (w1.sent, w1.ttft_p99) == (1, 0.2)
    assert (w2.start, w2.end, w2.sent) == (20.0, 25.0, 0)
    assert math.isnan(w2.ttft_p99)
    assert w2.within(0.1)
    assert w0.within(0.3)
    assert not w0.within(0.25)


def test_engine_seconds_are_the_samples_step_function() -> None:
    samples = [(0.0, 4.0), (10.0, 1.0), (20.0, 2.0)]
    assert integral(samples, 0.0, 30.0) == 40 + 10 + 20
    assert integral(samples, 5.0, 25.0) == 20 + 10 + 10
    assert integral([(3.0, 2.0)], 0.0, 10.0) == 20  # the first value before its sample
    assert integral([], 0.0, 10.0) == 0


def test_the_gateways_configuration_is_one_it_accepts(tmp_path: Path) -> None:
    sims = {f"e{i}": f"http://127.0.0.1:{i + 1}" for i in range(4)}
    for managed in (True, False):
        path = tmp_path / f"{managed}.toml"
        path.write_text(gateway_config(sims, 8080, managed=managed))
        settings = load_settings(path)
        assert settings.capacity.enabled is managed
        assert settings.capacity.every == 1
        assert settings.capacity.rule(MODEL) == Rule(**RULE)
