"""Pure routing policies over frozen backend snapshots. No I/O, no aiohttp."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Final, Literal, get_args

from policies.kv_index import KvIndex
from policies.latency import LatencyConfig, LatencyTracker, Load
from policies.least_load import LeastLoad
from policies.precise_prefix import MAX_BLOCKS, PrecisePrefix
from policies.predicted_latency import PredictedLatency, PredictionConfig
from policies.prefix import PrefixHasher, PrefixIndex
from policies.prefix_affinity import AffinityConfig, PrefixAffinity
from policies.scoring import Weights, score
from policies.simple import PowerOfTwo, RandomChoice, RoundRobin
from policies.types import (
    NO_NEEDS,
    BackendSnapshot,
    Decision,
    Needs,
    Outcome,
    Policy,
    Rng,
    RouteFacts,
)

PolicyName = Literal[
    "least_load",
    "round_robin",
    "random",
    "power_of_two",
    "prefix_affinity",
    "precise_prefix",
    "predicted_latency",
]
POLICY_NAMES: Final[tuple[PolicyName, ...]] = get_args(PolicyName)


def make_policy(
    name: PolicyName,
    weights: Weights | None = None,
    rng: Rng | None = None,
    *,
    affinity: AffinityConfig | None = None,
    previous: Policy | None = None,
    kv_index: KvIndex | None = None,
    kv_max_blocks: int = MAX_BLOCKS,
    tracker: LatencyTracker | None = None,
    prediction: PredictionConfig | None = None,
) -> Policy:
    """Build a policy by name; ``weights`` applies to the load-scoring ones.

    ``affinity`` configures ``prefix_affinity``. When ``previous`` (the policy being replaced)
    is a ``prefix_affinity`` hashing prompts the same way, the new one keeps its prefix index
    and decision counts, so tuning it live does not forget where prefixes are cached.
    ``tracker`` (the app's learned latencies) and ``prediction`` configure
    ``predicted_latency``, which composes with the prefix knowledge ``prediction.prefix`` names.
    """
    w = weights or Weights()
    r: Rng = rng or random.Random()
    if isinstance(previous, PredictedLatency):
        previous = previous.prefix  # what it learned of prefixes carries over
    if name == "least_load":
        return LeastLoad(weights=w, rng=r)
    if name == "predicted_latency":
        if tracker is None:
            raise ValueError("predicted_latency needs the latency tracker")
        pc = prediction or PredictionConfig()
        source = None
        if pc.prefix != "none":  # its prefix knowledge: the policy of that name, as built here
            kind: PolicyName = "precise_prefix" if pc.prefix == "precise" else "prefix_affinity"
            source = make_policy(
                kind,
                w,
                r,
                affinity=affinity,
                previous=previous,
                kv_index=kv_index,
                kv_max_blocks=kv_max_blocks,
            )
        assert source is None or isinstance(source, PrefixAffinity | PrecisePrefix)
        return PredictedLatency(tracker, w, r, affinity or AffinityConfig(), pc, source)
    if name == "prefix_affinity":
        config = affinity or AffinityConfig()
        if isinstance(previous, PrecisePrefix):
            previous = previous.approximate
        if isinstance(previous, PrefixAffinity) and previous.prefix_hasher == config.hasher:
            return PrefixAffinity(w, r, config, previous.index, previous.decisions, previous.heat)
        return PrefixAffinity(weights=w, rng=r, config=config)
    if name == "precise_prefix":
        config = affinity or AffinityConfig()
        if kv_index is None:
            raise ValueError("precise_prefix needs the KV-event index")
        old = previous.approximate if isinstance(previous, PrecisePrefix) else previous
        fallback = make_policy("prefix_affinity", w, r, affinity=config, previous=old)
        assert isinstance(fallback, PrefixAffinity)
        decisions = previous.decisions if isinstance(previous, PrecisePrefix) else None
        return PrecisePrefix(
            kv_index,
            w,
            r,
            config,
            max_blocks=kv_max_blocks,
            fallback=fallback,
            decisions=decisions or Counter(),
        )
    simple: dict[str, Callable[[], Policy]] = {
        "round_robin": RoundRobin,
        "random": lambda: RandomChoice(rng=r),
        "power_of_two": lambda: PowerOfTwo(weights=w, rng=r),
    }
    if name in simple:
        return simple[name]()
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


__all__ = [
    "NO_NEEDS",
    "POLICY_NAMES",
    "AffinityConfig",
    "BackendSnapshot",
    "Decision",
    "KvIndex",
    "LatencyConfig",
    "LatencyTracker",
    "LeastLoad",
    "Load",
    "Needs",
    "Outcome",
    "Policy",
    "PolicyName",
    "PowerOfTwo",
    "PrecisePrefix",
    "PredictedLatency",
    "PredictionConfig",
    "PrefixAffinity",
    "PrefixHasher",
    "PrefixIndex",
    "RandomChoice",
    "Rng",
    "RoundRobin",
    "RouteFacts",
    "Weights",
    "make_policy",
    "score",
]
