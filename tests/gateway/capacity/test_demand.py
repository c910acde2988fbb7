"""A model's demand level and trend, from samples at given times."""

from __future__ import annotations

import pytest

from gateway.capacity.demand import MAX_SAMPLES, Trend


def test_a_steady_rise_shows_as_its_slope() -> None:
    trend = Trend(window=30, smooth=0)
    for t in range(20):
        trend.add(float(t), 2.0 * t)
    assert trend.slope == pytest.approx(2.0)
    assert trend.level == 38.0


def test_the_level_is_smoothed_over_the_last_seconds() -> None:
    trend = Trend(window=30, smooth=3)
    for t, y in ((0, 100), (5, 4), (6, 6), (7, 8)):
        trend.add(float(t), float(y))
    assert trend.level == 6.0  # the samples at 5, 6 and 7 s


def test_samples_older_than_the_window_are_forgotten() -> None:
    trend = Trend(window=10, smooth=0)
    trend.add(0.0, 100.0)
    for t in range(20, 31):
        trend.add(float(t), 5.0)
    assert trend.slope == 0.0


def test_memory_is_bounded_whatever_the_rate_of_samples() -> None:
    trend = Trend(window=1e9, smooth=0)
    for i in range(MAX_SAMPLES * 3):
        trend.add(i * 1e-3, 1.0)
    assert len(trend._samples) == MAX_SAMPLES


def test_one_sample_or_a_clock_gone_back_has_no_trend() -> None:
    trend = Trend()
    trend.add(10.0, 4.0)
    assert trend.slope == 0.0
    trend.add(5.0, 8.0)
    assert trend.slope == 0.0
    assert trend.level == 8.0
