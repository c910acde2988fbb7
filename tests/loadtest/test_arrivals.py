"""Arrival processes: the rate and burstiness asked for (statistically, seeded)."""

from __future__ import annotations

import itertools
import statistics

import pytest

from loadtest.arrivals import ClosedLoop, LoadShape, OpenLoop


def gaps(arrivals: OpenLoop, n: int, seed: int = 1) -> list[float]:
    return list(itertools.islice(arrivals.gaps(seed), n))


def cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


def test_poisson_arrivals_have_the_rate_and_unit_cv() -> None:
    g = gaps(OpenLoop(rate=50.0), 20_000)
    assert statistics.fmean(g) == pytest.approx(1 / 50, rel=0.03)
    assert cv(g) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_arrivals_keep_the_rate_and_change_the_spread(burstiness: float) -> None:
    g = gaps(OpenLoop(rate=20.0, burstiness=burstiness), 20_000)
    assert statistics.fmean(g) == pytest.approx(1 / 20, rel=0.05)
    assert cv(g) == pytest.approx(burstiness**-0.5, rel=0.08)  # gamma: CV = 1/sqrt(shape)


def test_arrival_times_until_a_duration() -> None:
    times = OpenLoop(rate=100.0).times(3, until=30.0)
    assert times[0] == 0.0
    assert all(b > a for a, b in itertools.pairwise(times))
    assert times[-1] < 30.0
    assert len(times) == pytest.approx(3000, rel=0.06)


def test_arrival_times_are_reproducible() -> None:
    a = OpenLoop(rate=10.0, burstiness=0.5)
    assert a.times(4, count=50) == a.times(4, count=50)
    assert a.times(4, count=50) != a.times(5, count=50)
    assert len(a.times(4, count=50)) == 50


def test_load_shape_warmup_and_schedule() -> None:
    shape = LoadShape(OpenLoop(rate=10.0), duration=5.0, warmup=2.0, seed=1)
    assert shape.issue_until == 7.0
    assert shape.is_warmup(1.9)
    assert not shape.is_warmup(2.0)
    schedule = shape.schedule()
    assert schedule is not None
    assert schedule[-1] < 7.0
    assert LoadShape(ClosedLoop(4), requests=10).schedule() is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: ClosedLoop(0),
        lambda: OpenLoop(rate=0.0),
        lambda: OpenLoop(rate=1.0, burstiness=0.0),
        lambda: LoadShape(ClosedLoop(1)),
        lambda: LoadShape(ClosedLoop(1), duration=1.0, warmup=-1.0),
    ],
)
def test_bad_load_shapes_are_rejected(make: object) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case has its own message
        make()  # type: ignore[operator]
