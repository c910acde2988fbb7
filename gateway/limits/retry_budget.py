"""One budget for every extra attempt: retries, hedges and stream continuations.

Everything the gateway does to save a request adds load, and adds it when the fleet has least
to spare: a backend dies, every request on it is retried elsewhere, and the survivors drown.
So extra attempts draw on one budget (Finagle's and Envoy's retry budgets): over the last
``window`` seconds, at most ``ratio`` extra attempts per request that came in, plus
``min_per_second`` that a quiet fleet may always make. An attempt the budget refuses is not
made: the request fails as it would have without it, said in its log line and counted.

``Window`` and ``allows`` are pure (times given). ``LocalBudget`` keeps this replica's counts;
``gateway.limits.retry_budget_redis`` keeps the fleet's on the Redis the replicas share, so
that three replicas get one budget, not three.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

from policies.setting import check_settings, spec

Kind = Literal["retry", "hedge", "continuation"]
KINDS: Final[tuple[Kind, ...]] = ("retry", "hedge", "continuation")


@dataclass(frozen=True, slots=True)
class RetryBudgetPolicy:
    ratio: float = field(
        default=0.2,
        metadata=spec(
            "extra attempts (retries, hedges, continuations) per request, over the window", ge=0
        ),
    )
    min_per_second: float = field(
        default=5.0,
        metadata=spec(
            "extra attempts per second the fleet may always make, whatever its traffic", ge=0
        ),
    )
    window: float = field(
        default=10.0,
        metadata=spec("seconds the budget counts requests and extra attempts over", gt=0),
    )

    def __post_init__(self) -> None:
        check_settings(self)


def allows(policy: RetryBudgetPolicy, requests: float, extras: float) -> bool:
    """Whether one more extra attempt fits: ``requests`` and ``extras`` made in the window."""
    return extras + 1 <= policy.ratio * requests + policy.min_per_second * policy.window


class Window:
    """Counts over the last ``window`` seconds, in one-second buckets (bounded memory)."""

    __slots__ = ("_buckets", "_span")

    def __init__(self, window: float) -> None:
        self._span = max(1, math.ceil(window))
        self._buckets: dict[int, float] = {}

    def add(self, now: float, n: float = 1.0) -> None:
        second = int(now)
        self._buckets[second] = self._buckets.get(second, 0.0) + n
        if len(self._buckets) > self._span + 1:
            oldest = second - self._span
            for s in [s for s in self._buckets if s <= oldest]:
                del self._buckets[s]

    def total(self, now: float) -> float:
        oldest = int(now) - self._span
        return sum(n for s, n in self._buckets.items() if s > oldest)


class RetryBudget(Protocol):
    """What the request path holds: a deposit per request, a draw per extra attempt."""

    def deposit(self) -> None: ...

    async def take(self, kind: Kind) -> bool: ...


class LocalBudget:
    """This replica's budget (one process, or a fleet without Redis: per replica)."""

    def __init__(self, policy: RetryBudgetPolicy, clock: Callable[[], float]) -> None:
        self.policy = policy
        self._clock = clock
        self._requests = Window(policy.window)
        self._extras = Window(policy.window)
        self.taken: Counter[Kind] = Counter()
        self.refused: Counter[Kind] = Counter()

    def deposit(self) -> None:
        self._requests.add(self._clock())

    async def take(self, kind: Kind) -> bool:
        return self.take_now(kind)

    def take_now(self, kind: Kind) -> bool:
        now = self._clock()
        if not allows(self.policy, self._requests.total(now), self._extras.total(now)):
            self.refused[kind] += 1
            return False
        self._extras.add(now)
        self.taken[kind] += 1
        return True

    def use(self) -> tuple[float, float]:
        """Requests and extra attempts in the window now."""
        now = self._clock()
        return self._requests.total(now), self._extras.total(now)
