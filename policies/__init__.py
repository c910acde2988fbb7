"""Pure routing policies over frozen backend snapshots. No I/O, no aiohttp."""

from __future__ import annotations

import random
from typing import Final, Literal

from policies.least_load import LeastLoad
from policies.scoring import Weights, score
from policies.simple import PowerOfTwo, RandomChoice, RoundRobin
from policies.types import BackendSnapshot, Policy, Rng, RouteFacts

PolicyName = Literal["least_load", "round_robin", "random", "power_of_two"]
POLICY_NAMES: Final[tuple[PolicyName, ...]] = (
    "least_load",
    "round_robin",
    "random",
    "power_of_two",
)


def make_policy(name: PolicyName, weights: Weights | None = None, rng: Rng | None = None) -> Policy:
    """Build a policy by name; ``weights`` applies to the load-scoring ones."""
    w = weights or Weights()
    r: Rng = rng or random.Random()
    if name == "least_load":
        return LeastLoad(weights=w, rng=r)
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(rng=r)
    if name == "power_of_two":
        return PowerOfTwo(weights=w, rng=r)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


__all__ = [
    "POLICY_NAMES",
    "BackendSnapshot",
    "LeastLoad",
    "Policy",
    "PolicyName",
    "PowerOfTwo",
    "RandomChoice",
    "Rng",
    "RoundRobin",
    "RouteFacts",
    "Weights",
    "make_policy",
    "score",
]
