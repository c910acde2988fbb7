"""Passive health: a per-backend circuit breaker, pure and driven by an injected clock.

    closed --(``threshold`` consecutive failures)--> open
    open --(cooldown elapsed)--> half-open: exactly one trial request is let through
    half-open --trial succeeds--> closed (cooldown back to its base)
    half-open --trial fails--> open again, cooldown x ``growth`` (up to ``max_cooldown``)
    any --``trip`` (the backend stalled)--> open, the cooldown grown unless it had closed

A failure is a connect error, a reset or a 5xx; a 4xx is the client's fault and counts as
success. A trial request that ends without a verdict (the client left) gives the trial back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from policies.setting import check_settings, spec


class Circuit(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class CircuitPolicy:
    threshold: int = field(default=5, metadata=spec("consecutive failures to open", ge=1))
    cooldown: float = field(default=5.0, metadata=spec("first open period, seconds", gt=0))
    growth: float = field(default=2.0, metadata=spec("cooldown factor on each re-opening", ge=1))
    max_cooldown: float = field(default=120.0, metadata=spec("longest open period, seconds", gt=0))

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(slots=True)
class CircuitBreaker:
    policy: CircuitPolicy
    state: Circuit = Circuit.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    current_cooldown: float = 0.0
    trial_in_flight: bool = False
    times_opened: int = 0

    def allows(self, now: float) -> bool:
        """Whether a new request may be sent now (does not claim the half-open trial)."""
        if self.state is Circuit.CLOSED:
            return True
        if self.state is Circuit.OPEN:
            return now - self.opened_at >= self.current_cooldown
        return not self.trial_in_flight

    def on_send(self, now: float) -> None:
        """A request is being sent: past the cooldown it becomes the half-open trial."""
        if self.state is Circuit.OPEN and now - self.opened_at >= self.current_cooldown:
            self.state = Circuit.HALF_OPEN
        if self.state is Circuit.HALF_OPEN:
            self.trial_in_flight = True

    def on_success(self) -> None:
        self.failures = 0
        if self.state is Circuit.HALF_OPEN:
            self.state = Circuit.CLOSED
            self.current_cooldown = 0.0
        self.trial_in_flight = False

    def on_failure(self, now: float) -> None:
        self.failures += 1
        if self.state is Circuit.HALF_OPEN:
            self._open(now, grow=True)
        elif self.state is Circuit.CLOSED and self.failures >= self.policy.threshold:
            self._open(now, grow=False)
        self.trial_in_flight = False

    def trip(self, now: float) -> None:
        """Open at once, whatever the count (a stall seen on the request path). The cooldown
        grows if no good trial has closed the circuit since it last opened, so a backend that
        keeps stalling is tried less and less often."""
        self._open(now, grow=True)
        self.trial_in_flight = False

    def on_abandoned(self) -> None:
        """The request ended without telling us anything about the backend."""
        self.trial_in_flight = False

    def _open(self, now: float, *, grow: bool) -> None:
        if grow and self.current_cooldown > 0:
            cooldown = min(self.current_cooldown * self.policy.growth, self.policy.max_cooldown)
        else:
            cooldown = self.policy.cooldown
        self.state = Circuit.OPEN
        self.opened_at = now
        self.current_cooldown = cooldown
        self.times_opened += 1
