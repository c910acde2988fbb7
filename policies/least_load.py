"""``least_load``: the candidate with the lowest load score; ties broken at random."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from policies.scoring import Weights, score
from policies.types import NO_NEEDS, BackendSnapshot, Decision, Needs, Outcome, Rng, RouteFacts


@dataclass(slots=True)
class LeastLoad:
    weights: Weights = field(default_factory=Weights)
    rng: Rng = field(default_factory=random.Random)
    name: str = "least_load"

    @property
    def needs(self) -> Needs:
        return NO_NEEDS

    def on_result(self, facts: RouteFacts, decision: Decision, outcome: Outcome) -> None:
        pass  # the load figures say everything it weighs

    def choose(self, facts: RouteFacts, candidates: list[BackendSnapshot]) -> Decision | None:
        if not candidates:
            return None
        best: list[BackendSnapshot] = []
        best_score = float("inf")
        for snap in candidates:
            s = score(snap, self.weights)
            if s < best_score:
                best_score = s
                best = [snap]
            elif s == best_score:
                best.append(snap)
        # Never "first in the list": a burst of ties would all land on one backend.
        return Decision(best[self.rng.randrange(len(best))] if len(best) > 1 else best[0])
