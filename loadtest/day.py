"""A compressed day of demand and what a run of it shows. Pure: seeded schedules, no clock.

- ``Day``: an arrival rate over time, linear between its points (a trough, a ramp to the
  peak, the peak, a ramp down, the trough again: ``compressed_day``); ``arrivals`` draws the
  send times of a Poisson process whose rate follows it (Lewis and Shedler's thinning: a
  Poisson process at the peak rate, each arrival kept with probability rate(t) / peak).
- ``windows``: each window's requests by send time: how many, how many failed, TTFT p50 and
  p99 of the answered ones.
- ``integral``: a sampled step function's area (engine-seconds from engines counted each
  second).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from loadtest.stats import percentile


@dataclass(frozen=True, slots=True)
class Day:
    points: tuple[tuple[float, float], ...]  # (seconds from the start, requests/s), by time

    def __post_init__(self) -> None:
        if len(self.points) < 2 or self.points[0][0] != 0.0:
            raise ValueError("a day needs two points or more, the first at 0 s")
        if any(b[0] <= a[0] for a, b in itertools.pairwise(self.points)):
            raise ValueError("a day's points go forward in time")
        if any(not r > 0 for _, r in self.points):
            raise ValueError("a day's rates are positive")

    @property
    def duration(self) -> float:
        return self.points[-1][0]

    @property
    def peak(self) -> float:
        return max(r for _, r in self.points)

    @property
    def trough(self) -> float:
        return min(r for _, r in self.points)

    def rate(self, t: float) -> float:
        """Requests/s at ``t`` (the first rate before 0, the last after the end)."""
        times = [p[0] for p in self.points]
        i = bisect.bisect_right(times, t)
        if i == 0:
            return self.points[0][1]
        if i == len(self.points):
            return self.points[-1][1]
        (t0, r0), (t1, r1) = self.points[i - 1], self.points[i]
        return r0 + (r1 - r0) * (t - t0) / (t1 - t0)

    def requests(self) -> float:
        """The requests the day brings on average (the area under its rate)."""
        return sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in itertools.pairwise(self.points))

    def arrivals(self, seed: int, *, start: float = 0.0) -> list[float]:
        """Send times from ``start`` to the day's end, seeded."""
        rng = random.Random(f"day-{seed}")
        top = self.peak
        out: list[float] = []
        t = start
        while True:
            t += rng.expovariate(top)
            if t >= self.duration:
                return out
            if rng.random() * top < self.rate(t):
                out.append(t)


def compressed_day(
    trough: float, peak: float, *, trough_s: float, ramp_s: float, peak_s: float
) -> Day:
    """Trough, a linear ramp to the peak, the peak, a ramp down, the trough again."""
    if not 0 < trough <= peak:
        raise ValueError("0 < trough <= peak")
    t1 = trough_s
    t2 = t1 + ramp_s
    t3 = t2 + peak_s
    t4 = t3 + ramp_s
    points = ((0.0, trough), (t1, trough), (t2, peak), (t3, peak), (t4, trough))
    return Day((*points, (t4 + trough_s, trough)))


@dataclass(frozen=True, slots=True)
class Window:
    start: float
    end: float
    sent: int
    failed: int
    ttft_p50: float  # seconds; NaN without an answered request
    ttft_p99: float

    def within(self, slo: float) -> bool:
        """TTFT p99 within ``slo`` (a window with no answered request is)."""
        return math.isnan(self.ttft_p99) or self.ttft_p99 <= slo


def windows(
    requests: Sequence[tuple[float, float | None, bool]], width: float, start: float, end: float
) -> list[Window]:
    """``requests`` as (sent at, TTFT or None, ok), grouped by send time into windows of
    ``width`` seconds from ``start`` (the last one ends at ``end``, perhaps shorter)."""
    if width <= 0 or end <= start:
        raise ValueError("windows need a width > 0 and an end after their start")
    count = math.ceil((end - start) / width - 1e-9)
    sent = [0] * count
    failed = [0] * count
    ttfts: list[list[float]] = [[] for _ in range(count)]
    for at, ttft, ok in requests:
        if not start <= at < end:
            continue
        i = min(int((at - start) // width), count - 1)
        sent[i] += 1
        if not ok:
            failed[i] += 1
        elif ttft is not None:
            ttfts[i].append(ttft)
    out = []
    for i in range(count):
        values = sorted(ttfts[i])
        out.append(
            Window(
                start=start + i * width,
                end=min(start + (i + 1) * width, end),
                sent=sent[i],
                failed=failed[i],
                ttft_p50=percentile(values, 50),
                ttft_p99=percentile(values, 99),
            )
        )
    return out


def integral(samples: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """The area from ``start`` to ``end`` of the step function that takes each sample's value
    (time, value) from its time until the next sample's (the first one's before it)."""
    if not samples or end <= start:
        return 0.0
    total = 0.0
    for i, (t, value) in enumerate(samples):
        lo = start if i == 0 else max(t, start)
        hi = samples[i + 1][0] if i + 1 < len(samples) else end
        hi = min(hi, end)
        if hi > lo:
            total += value * (hi - lo)
    return total
