"""When to send: load shapes. Pure: seeded schedules, no clock.

- ``ClosedLoop(concurrency)``: that many workers, each sending its next request as soon as
  its previous one ends. The offered load follows the server's speed.
- ``OpenLoop(rate, burstiness)``: requests arrive on their own schedule, whatever the server
  does. Gaps between arrivals are gamma-distributed with shape ``burstiness`` and mean
  ``1/rate``, vLLM's ``benchmark_serving`` definition: burstiness 1 is a Poisson process,
  below 1 burstier (clumps and lulls), above 1 more regular.

A run stops issuing after ``duration`` seconds or ``requests`` requests (whichever is given
first) and then waits for what is in flight. Requests *sent* during the first ``warmup``
seconds are left out of the figures (the measured duration is ``duration`` after them).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    concurrency: int

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")

    def describe(self) -> str:
        return f"closed loop, concurrency {self.concurrency}"


@dataclass(frozen=True, slots=True)
class OpenLoop:
    rate: float  # requests per second
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError("rate must be positive")
        if not self.burstiness > 0:
            raise ValueError("burstiness must be positive")

    def describe(self) -> str:
        kind = "Poisson" if self.burstiness == 1.0 else f"gamma, burstiness {self.burstiness:g}"
        return f"open loop, {self.rate:g} req/s ({kind})"

    def gaps(self, seed: int) -> Iterator[float]:
        """Endless seeded gaps between arrivals, in seconds."""
        rng = random.Random(f"arrivals-{seed}")
        scale = 1.0 / (self.rate * self.burstiness)
        while True:
            yield rng.gammavariate(self.burstiness, scale)

    def times(
        self, seed: int, *, until: float | None = None, count: int | None = None
    ) -> list[float]:
        """Arrival times from 0 (the first request goes at once), up to ``until`` or ``count``."""
        if until is None and count is None:
            raise ValueError("give until or count")
        out: list[float] = []
        t = 0.0
        for gap in self.gaps(seed):
            if count is not None and len(out) >= count:
                break
            if until is not None and t >= until:
                break
            out.append(t)
            t += gap
        return out


Arrivals = ClosedLoop | OpenLoop


@dataclass(frozen=True, slots=True)
class LoadShape:
    arrivals: Arrivals
    duration: float | None = None  # measured seconds, after the warm-up
    requests: int | None = None  # total requests to send (warm-up included)
    warmup: float = 0.0  # seconds whose requests are not measured
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration is None and self.requests is None:
            raise ValueError("a load needs a duration or a request count")
        if self.duration is not None and not self.duration > 0:
            raise ValueError("duration must be positive")
        if self.requests is not None and self.requests < 1:
            raise ValueError("requests must be at least 1")
        if self.warmup < 0:
            raise ValueError("warmup must not be negative")

    @property
    def issue_until(self) -> float | None:
        """Seconds after the start when no more requests are sent, if time-bounded."""
        return None if self.duration is None else self.warmup + self.duration

    def is_warmup(self, sent_at: float) -> bool:
        return sent_at < self.warmup

    def schedule(self) -> list[float] | None:
        """The open loop's send times, or None for a closed loop."""
        if isinstance(self.arrivals, ClosedLoop):
            return None
        return self.arrivals.times(self.seed, until=self.issue_until, count=self.requests)

    def describe(self) -> str:
        parts = [self.arrivals.describe()]
        if self.duration is not None:
            parts.append(f"{self.duration:g} s")
        if self.requests is not None:
            parts.append(f"{self.requests} requests")
        if self.warmup:
            parts.append(f"{self.warmup:g} s warm-up")
        return ", ".join(parts)
