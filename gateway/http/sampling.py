"""How many lines a flood of refusals may write: a token bucket, with the clock injected.

Hostile or broken clients can send thousands of bad requests a second; each is worth one log
line, but not thousands. ``LogSampler.admit`` lets ``rate`` lines through per ``per`` seconds
(a burst of ``rate`` at once), counts the rest, and tells the next line through how many were
left out, so the count of refusals stays exact in the logs even when the lines are not.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class LogSampler:
    """At most ``rate`` lines per ``per`` seconds (on average; ``rate`` in a burst)."""

    __slots__ = ("_clock", "_last", "_per", "_rate", "_suppressed", "_tokens")

    def __init__(
        self, *, rate: int = 10, per: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate < 1 or per <= 0:
            raise ValueError("rate must be at least 1 and per positive")
        self._clock = clock
        self._rate = rate
        self._per = per
        self._tokens = float(rate)
        self._last = clock()
        self._suppressed = 0

    def admit(self) -> int | None:
        """None: leave this line out (it is counted). Else write it, with the number of lines
        left out since the last one written (0 when none were)."""
        now = self._clock()
        elapsed = now - self._last
        self._last = now
        if elapsed > 0:
            self._tokens = min(float(self._rate), self._tokens + elapsed * self._rate / self._per)
        if self._tokens < 1.0 - 1e-9:  # (a whole token, give or take float rounding)
            self._suppressed += 1
            return None
        self._tokens = max(self._tokens - 1.0, 0.0)
        suppressed, self._suppressed = self._suppressed, 0
        return suppressed

    @property
    def suppressed(self) -> int:
        """Lines left out since the last one written."""
        return self._suppressed
