"""A model's demand over time: its level now and how fast it moves. Pure (times are given).

The level is what one engine's capacity is counted in: requests on the model's engines
(running or waiting, as the engines report them) plus those held or queued in the gateway. By
Little's law it is the arrival rate times how long a request takes, so a rising arrival rate
shows as a rising level; the trend is the least-squares slope of the samples of the last
``window`` seconds, which the plan (``gateway.capacity.plan.need``) projects one wake time
ahead.

The level is smoothed over ``smooth`` seconds, which the manager sets to two wake times
(``smoothing``): a burst over before a woken engine could take any of it is not demand for one
(a Poisson trough of 2 requests a second has seconds at 8), while a rise that lasts is
followed, the smoothing's lag made up along the trend.
"""

from __future__ import annotations

from collections import deque
from typing import Final

MAX_SAMPLES: Final = 512  # whatever the turn period, a bounded memory per model
MIN_SMOOTH: Final = 3.0  # seconds: one request more or less between two turns is no change


def smoothing(wake_time: float, window: float) -> float:
    """The seconds a level is smoothed over for engines that take ``wake_time`` to wake."""
    return min(window, max(MIN_SMOOTH, 2 * wake_time))


class Trend:
    def __init__(self, window: float = 30.0, smooth: float = 3.0) -> None:
        if not 0 <= smooth <= window or window <= 0:
            raise ValueError("a trend's window must be > 0 s, and its smoothing within it")
        self.window = window
        self.smooth = smooth
        self._samples: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)

    def add(self, t: float, level: float) -> None:
        samples = self._samples
        if samples and t < samples[-1][0]:  # the clock went back: start again
            samples.clear()
        samples.append((t, level))
        while samples and t - samples[0][0] > self.window:
            samples.popleft()

    @property
    def level(self) -> float:
        """The mean of the samples of the last ``smooth`` seconds, carried to now along a rising
        trend (the mean of a rise lags it by the age of the samples' mean time)."""
        if not self._samples:
            return 0.0
        last = self._samples[-1][0]
        recent = [(t, y) for t, y in self._samples if last - t <= self.smooth]
        mean = sum(y for _, y in recent) / len(recent)
        lag = last - sum(t for t, _ in recent) / len(recent)
        return mean + max(self.slope, 0.0) * lag

    @property
    def slope(self) -> float:
        """Growth per second over the window (0 with fewer than two samples or no span)."""
        n = len(self._samples)
        if n < 2:
            return 0.0
        mean_t = sum(t for t, _ in self._samples) / n
        mean_y = sum(y for _, y in self._samples) / n
        var = sum((t - mean_t) ** 2 for t, _ in self._samples)
        if var <= 0:
            return 0.0
        cov = sum((t - mean_t) * (y - mean_y) for t, y in self._samples)
        return cov / var
