"""Active health of one backend, from its probes: a pure state machine.

``unknown`` until the first probe answers (a new backend gets no traffic before that), then
``up`` or ``down``. Down after ``fall`` consecutive probe failures; back up only after ``rise``
consecutive successes. A backend that has never been up (still starting, loading its model)
comes up on its first good probe. A failing or stale metrics scrape lowers the bar to go down
by one probe, but never marks a backend down on its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from policies.setting import check_settings, spec


class Health(enum.Enum):
    UNKNOWN = "unknown"
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    fall: int = field(
        default=3, metadata=spec("consecutive failed probes to mark a backend down", ge=1)
    )
    rise: int = field(default=2, metadata=spec("consecutive good probes to bring it back", ge=1))

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(slots=True)
class HealthTracker:
    policy: HealthPolicy
    state: Health = Health.UNKNOWN
    failures: int = 0
    successes: int = 0
    last_error: str | None = None
    ever_up: bool = False

    def probe_ok(self) -> Health:
        self.failures = 0
        self.successes += 1
        self.last_error = None
        if self.state is not Health.UP and (not self.ever_up or self.successes >= self.policy.rise):
            self.state = Health.UP
            self.ever_up = True
        return self.state

    def probe_failed(self, error: str, *, scrape_failing: bool = False) -> Health:
        self.successes = 0
        self.failures += 1
        self.last_error = error
        needed = max(1, self.policy.fall - (1 if scrape_failing else 0))
        if self.state is not Health.DOWN and (
            self.failures >= needed or self.state is Health.UNKNOWN
        ):
            self.state = Health.DOWN
        return self.state

    def mark_down(self, error: str) -> Health:
        """Down at once, whatever the probes said (a stall seen on the request path); back up
        through ``rise`` good probes, as after failed ones."""
        self.successes = 0
        self.last_error = error
        self.state = Health.DOWN
        return self.state
