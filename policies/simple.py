"""Baseline policies for comparison: ``round_robin``, ``random`` and ``power_of_two``."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from policies.scoring import Weights, score
from policies.types import NO_NEEDS, BackendSnapshot, Decision, Needs, Outcome, Rng, RouteFacts


class _Stateless:
    """What the baseline policies share: they ask nothing and learn nothing."""

    __slots__ = ()

    @property
    def needs(self) -> Needs:
        return NO_NEEDS

    def on_result(self, facts: RouteFacts, decision: Decision, outcome: Outcome) -> None:
        pass


@dataclass(slots=True)
class RoundRobin(_Stateless):
    """Cycles through the candidates; the cursor survives changes in the candidate list."""

    name: str = "round_robin"
    _cursor: int = 0

    @property
    def weights(self) -> None:
        return None

    def choose(self, facts: RouteFacts, candidates: list[BackendSnapshot]) -> Decision | None:
        if not candidates:
            return None
        choice = candidates[self._cursor % len(candidates)]
        self._cursor = (self._cursor + 1) % 1_000_000_007
        return Decision(choice)


@dataclass(slots=True)
class RandomChoice(_Stateless):
    rng: Rng = field(default_factory=random.Random)
    name: str = "random"

    @property
    def weights(self) -> None:
        return None

    def choose(self, facts: RouteFacts, candidates: list[BackendSnapshot]) -> Decision | None:
        if not candidates:
            return None
        return Decision(candidates[self.rng.randrange(len(candidates))])


@dataclass(slots=True)
class PowerOfTwo(_Stateless):
    """Two distinct random candidates; the lower score wins, a tie goes to either at random."""

    weights: Weights = field(default_factory=Weights)
    rng: Rng = field(default_factory=random.Random)
    name: str = "power_of_two"

    def choose(self, facts: RouteFacts, candidates: list[BackendSnapshot]) -> Decision | None:
        n = len(candidates)
        if n == 0:
            return None
        if n == 1:
            return Decision(candidates[0])
        i = self.rng.randrange(n)
        j = self.rng.randrange(n - 1)
        if j >= i:
            j += 1
        a, b = candidates[i], candidates[j]
        sa, sb = score(a, self.weights), score(b, self.weights)
        if sa == sb:
            return Decision(a if self.rng.random() < 0.5 else b)
        return Decision(a if sa < sb else b)
