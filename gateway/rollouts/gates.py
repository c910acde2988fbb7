"""A canary's gates: its figures beside the stable pool's over the same window, judged. Pure.

The counts are cumulative, as the gateway keeps them (``llm_gateway_pool_*``, summed over the
fleet's reports: ``gateway.fleet.figures.PoolCounts``): a window's figures are the difference
of two readings (``PoolCounts.since``), and its
quantiles come from the difference of the cumulative histogram buckets. The gates:

- ``errors``: the canary's error rate at most the stable pool's plus ``error_margin``;
- ``ttft_p99`` and ``itl_p50``: the canary's at most the stable pool's times a factor;
- ``ttft_p99_slo`` and ``itl_p50_slo``: nothing worse than the absolute SLOs, if set;
- ``probes``: the share of identical tokens in the two pools' answers to the same greedy
  prompts at least ``min_agreement``, if set (a canary fast and wrong).

A gate with nothing to judge (no request answered, no token timed, the stable pool idle for a
relative gate) passes: how much evidence a step needs is the plan's ``min_requests``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.fleet.figures import PoolCounts, quantile


@dataclass(frozen=True, slots=True)
class Gates:
    """What the canary must keep to, against the stable pool over the same window."""

    error_margin: float = 0.02  # error rate at most stable's + this (a share: 0.02 = 2 points)
    ttft_p99_factor: float = 1.5  # TTFT p99 at most stable's x this
    itl_p50_factor: float = 1.5  # ITL p50 at most stable's x this
    ttft_p99_slo: float | None = None  # seconds, absolute
    itl_p50_slo: float | None = None  # seconds, absolute
    min_agreement: float | None = None  # probes: share of identical tokens, 0-1

    def problems(self) -> list[str]:
        """What is wrong with these gates (empty: nothing)."""
        out = []
        if not (math.isfinite(self.error_margin) and 0 <= self.error_margin <= 1):
            out.append("error_margin must be between 0 and 1")
        for name in ("ttft_p99_factor", "itl_p50_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 1):
                out.append(f"{name} must be a number >= 1")
        for name in ("ttft_p99_slo", "itl_p50_slo"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                out.append(f"{name} must be a number of seconds > 0")
        agreement = self.min_agreement
        if agreement is not None and not (math.isfinite(agreement) and 0 <= agreement <= 1):
            out.append("min_agreement must be between 0 and 1")
        return out


@dataclass(frozen=True, slots=True)
class GateReading:
    """One gate's figures: the canary's, the stable pool's (relative gates), the limit the
    canary was held to (None: nothing to judge), and whether it passed."""

    gate: str
    canary: float | None
    stable: float | None
    limit: float | None
    passed: bool

    def doc(self) -> dict[str, object]:
        return {
            "gate": self.gate,
            "canary": _round(self.canary),
            "stable": _round(self.stable),
            "limit": _round(self.limit),
            "passed": self.passed,
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _at_most(
    gate: str, canary: float | None, stable: float | None, limit: float | None
) -> GateReading:
    passed = canary is None or limit is None or canary <= limit
    return GateReading(gate, canary, stable, limit, passed)


def judge(
    canary: PoolCounts,
    stable: PoolCounts,
    gates: Gates,
    agreement: float | None = None,
) -> tuple[GateReading, ...]:
    """Every gate's reading for one window (``agreement``: the probes', if any were sent)."""
    c_err, s_err = canary.error_rate, stable.error_rate
    err_limit = None if s_err is None else s_err + gates.error_margin
    c_ttft, s_ttft = quantile(canary.ttft, 0.99), quantile(stable.ttft, 0.99)
    c_itl, s_itl = quantile(canary.itl, 0.5), quantile(stable.itl, 0.5)
    readings = [
        _at_most("errors", c_err, s_err, err_limit),
        _at_most("ttft_p99", c_ttft, s_ttft, _times(s_ttft, gates.ttft_p99_factor)),
        _at_most("itl_p50", c_itl, s_itl, _times(s_itl, gates.itl_p50_factor)),
    ]
    if gates.ttft_p99_slo is not None:
        readings.append(_at_most("ttft_p99_slo", c_ttft, None, gates.ttft_p99_slo))
    if gates.itl_p50_slo is not None:
        readings.append(_at_most("itl_p50_slo", c_itl, None, gates.itl_p50_slo))
    if gates.min_agreement is not None:
        passed = agreement is None or agreement >= gates.min_agreement
        readings.append(GateReading("probes", agreement, None, gates.min_agreement, passed))
    return tuple(readings)


def _times(x: float | None, factor: float) -> float | None:
    return None if x is None else x * factor


def certain_error_breach(
    canary: PoolCounts, stable: PoolCounts, gates: Gates, min_requests: int
) -> bool:
    """Whether the canary's errors already break the error gate however the rest of the
    step's ``min_requests`` go: the rollout need not wait for them to abort."""
    s_err = stable.error_rate
    if s_err is None or not canary.errors:
        return False
    return canary.errors > (s_err + gates.error_margin) * max(canary.requests, min_requests)


def agreement(a: Sequence[object], b: Sequence[object]) -> float:
    """The share of identical tokens, position by position, over the longer answer (1.0 for
    two empty answers): how alike two greedy answers to one prompt are."""
    longest = max(len(a), len(b))
    if not longest:
        return 1.0
    return sum(1 for x, y in zip(a, b, strict=False) if x == y) / longest
