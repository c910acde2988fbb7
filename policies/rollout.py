"""Splitting a public model name (an alias) between pools by weight. Pure: no I/O.

Without a sticky key a pool is drawn at random in proportion to its weight. With one (a
session or user id) the choice is weighted rendezvous hashing: each pool scores
``weight / -ln(u)`` with ``u`` a uniform hash of (key, pool) and the highest wins. A key's
scores do not depend on the other pools' weights, so when a weight rises only keys moving
*to* that pool change, and when it falls only keys leaving it: the share that must move.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Set

from policies.types import Rng

PoolWeights = Mapping[str, float]


class WeightsError(ValueError):
    """A weight change that cannot be applied; the message says why."""


def check_weights(weights: PoolWeights, pools: Set[str]) -> dict[str, float]:
    """The weights as a plain dict, or ``WeightsError``: known pools, >= 0, sum > 0."""
    if not weights:
        raise WeightsError("at least one pool is needed")
    unknown = sorted(set(weights) - pools)
    if unknown:
        raise WeightsError(f"unknown pool(s): {', '.join(unknown)}")
    out: dict[str, float] = {}
    for name, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
            raise WeightsError(f"weight of {name!r} must be a finite number >= 0, got {w!r}")
        out[name] = float(w)
    if sum(out.values()) <= 0:
        raise WeightsError("weights must not all be 0")
    return out


def _unit(key: str, pool: str) -> float:
    """A uniform number in (0, 1), fixed for (key, pool)."""
    digest = hashlib.blake2b(f"{pool}\x00{key}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / 2.0**64


def choose_pool(weights: PoolWeights, key: str | None, rng: Rng) -> str | None:
    """The pool for one request: sticky on ``key`` if given, else drawn; None if all are 0."""
    if key is not None:
        best, best_score = None, -1.0
        for name, w in weights.items():
            if w > 0:
                s = w / -math.log(_unit(key, name))
                if s > best_score:
                    best, best_score = name, s
        return best
    total = sum(w for w in weights.values() if w > 0)
    if total <= 0:
        return None
    x = rng.random() * total
    last = None
    for name, w in weights.items():
        if w > 0:
            last = name
            x -= w
            if x < 0:
                return name
    return last  # rounding at the very top
