"""A model's demand level and trend, from samples at given times."""

from __future__ import annotations

import pytest

from gateway.capacity.demand import MAX_SAMPLES, MIN_SMOOTH, Trend, smoothing


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


def test_the_smoothing_is_two_wake_times_within_the_window() -> None:
    assert smoothing(wake_time=5.0, window=30.0) == 10.0
    assert smoothing(wake_time=0.5, window=30.0) == MIN_SMOOTH
    assert smoothing(wake_time=60.0, window=30.0) == 30.0


def test_a_burst_shorter_than_the_smoothing_is_not_a_level() -> None:
    """A trough of 3 requests with a 2-s burst to 12: over 10 s the level stays under what one
    engine serves with headroom (10 / 1.5), where a 3-s mean goes over it."""
    trend = Trend(window=30, smooth=10)
    for t in range(30):
        trend.add(float(t), 12.0 if t >= 28 else 3.0)
    assert trend.level < 10 / 1.5
    short = Trend(window=30, smooth=3)
    for t in range(30):
        short.add(float(t), 12.0 if t >= 28 else 3.0)
    assert short.level > 10 / 1.5


def test_a_steady_rise_is_not_lagged_by_the_smoothing() -> None:
    """On a rise of 2 a second the mean of the last 10 s lags 5 s behind (10 requests): the
    level is carried to now along the trend."""
    trend = Trend(window=30, smooth=10)
    for t in range(21):
        trend.add(float(t), 2.0 * t)
    assert trend.level == pytest.approx(40.0)


def test_a_fall_is_not_carried_ahead() -> None:
    trend = Trend(window=30, smooth=10)
    for t in range(21):
        trend.add(float(t), 100.0 - 2.0 * t)
    assert trend.level == pytest.approx(70.0)  # the mean of the last 11 samples (80 .. 60)
