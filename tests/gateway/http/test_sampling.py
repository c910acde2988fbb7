"""The refusal log's sampler (``gateway.http.sampling.LogSampler``), on an injected clock."""

from __future__ import annotations

import pytest

from gateway.http import LogSampler


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_of_rate_lines_is_written_then_the_rest_counted() -> None:
    clock = Clock()
    sampler = LogSampler(rate=10, per=1.0, clock=clock)
    assert [sampler.admit() for _ in range(10)] == [0] * 10
    assert [sampler.admit() for _ in range(5)] == [None] * 5
    assert sampler.suppressed == 5


def test_the_next_line_written_carries_the_count_left_out() -> None:
    clock = Clock()
    sampler = LogSampler(rate=10, per=1.0, clock=clock)
    for _ in range(10 + 7):
        sampler.admit()
    clock.now += 0.1  # one line's worth of time
    assert sampler.admit() == 7
    assert sampler.admit() is None
    assert sampler.suppressed == 1


def test_lines_come_back_at_the_rate_and_the_burst_is_capped() -> None:
    clock = Clock()
    sampler = LogSampler(rate=10, per=1.0, clock=clock)
    for _ in range(10):
        sampler.admit()
    clock.now += 0.5
    assert sum(sampler.admit() is not None for _ in range(20)) == 5
    clock.now += 3600  # a long quiet: no more than a burst is saved up
    assert sum(sampler.admit() is not None for _ in range(20)) == 10


def test_a_steady_trickle_under_the_rate_is_never_sampled() -> None:
    clock = Clock()
    sampler = LogSampler(rate=10, per=1.0, clock=clock)
    for _ in range(1000):
        clock.now += 0.1
        assert sampler.admit() == 0


def test_a_clock_going_back_gives_nothing_back() -> None:
    clock = Clock()
    sampler = LogSampler(rate=2, per=1.0, clock=clock)
    sampler.admit()
    sampler.admit()
    clock.now -= 10
    assert sampler.admit() is None


@pytest.mark.parametrize(("rate", "per"), [(0, 1.0), (1, 0.0)])
def test_nonsense_settings_are_refused(rate: int, per: float) -> None:
    with pytest.raises(ValueError, match="rate"):
        LogSampler(rate=rate, per=per)
