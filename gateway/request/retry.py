"""When and how long to wait before trying another backend. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from policies import Rng
from policies.setting import check_settings, spec

# Answers that mean "this backend cannot take it now", worth another backend's try.
RETRYABLE_STATUS: Final = frozenset({429, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = field(
        default=3, metadata=spec("attempts per request, the first included", ge=1)
    )
    deadline: float = field(
        default=15.0, metadata=spec("no new attempt after this many seconds", gt=0)
    )
    backoff_base: float = field(
        default=0.05, metadata=spec("seconds to wait after the first failure", ge=0)
    )
    backoff_max: float = field(
        default=2.0, metadata=spec("longest wait between attempts, seconds", ge=0)
    )
    backoff_factor: float = field(
        default=1.5, metadata=spec("wait factor on each further failure", ge=1)
    )
    jitter: float = field(
        default=0.2, metadata=spec("+/- this fraction of each backoff", ge=0, le=1)
    )

    def __post_init__(self) -> None:
        check_settings(self)

    def backoff(self, failed_attempts: int, rng: Rng) -> float:
        """Seconds to wait after the ``failed_attempts``-th failure (1-based), jittered."""
        raw = self.backoff_base * self.backoff_factor ** max(0, failed_attempts - 1)
        capped = min(raw, self.backoff_max)
        return max(0.0, capped * (1.0 + self.jitter * (2.0 * rng.random() - 1.0)))

    def allows(self, attempts_made: int, elapsed: float) -> bool:
        """Whether another attempt may follow these (before the backoff is drawn)."""
        return attempts_made < self.max_attempts and elapsed < self.deadline

    def may_retry(self, attempts_made: int, elapsed: float, next_wait: float) -> bool:
        return attempts_made < self.max_attempts and elapsed + next_wait < self.deadline

    def next_wait(self, attempts_made: int, elapsed: float, rng: Rng) -> float | None:
        """Seconds to wait before the next attempt, or ``None``: give up."""
        wait = self.backoff(attempts_made, rng)
        return wait if self.may_retry(attempts_made, elapsed, wait) else None
