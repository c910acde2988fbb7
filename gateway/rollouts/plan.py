"""A rollout's plan and the step-by-step decision it drives. Pure: the clock and the figures
are handed in.

A plan moves an alias from its ``stable`` pool to its ``canary`` pool through ``steps`` (the
canary's share in per cent, rising, the last 100). At each step the canary's figures and the
stable pool's over the same window (since the step began) are judged by the gates
(``gateway.rollouts.gates``). ``decide`` says what to do now:

- ``abort``: a gate failed, with at least ``min_requests`` canary requests in the window (or
  the canary's errors break the error gate whatever the rest do): back to stable at once;
- ``hold``: paused, too few canary requests yet, or the step's ``hold_s`` not over;
- ``advance`` to the next step, or ``promote`` after the last: the hold is over, with enough
  requests, and every gate passed.

A step is an index into ``steps`` (0 the first) in the data; every text people read counts
steps from 1 (``Plan.step_name``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.fleet.figures import PoolCounts
from gateway.rollouts.gates import GateReading, Gates, certain_error_breach, judge

RolloutAction = Literal["hold", "advance", "promote", "abort"]
DEFAULT_STEPS = (1.0, 5.0, 25.0, 50.0, 100.0)
MAX_PROBES = 16
MAX_PROBE_CHARS = 4000
MAX_PROBE_TOKENS = 256


class PlanError(ValueError):
    """A plan that cannot be run; the message says why."""


@dataclass(frozen=True, slots=True)
class Plan:
    alias: str
    stable: str  # the pool the alias is served by now
    canary: str  # the pool it moves to
    steps: tuple[float, ...] = DEFAULT_STEPS  # the canary's share at each step, in per cent
    hold_s: float = 300.0  # the least time at a step
    min_requests: int = 100  # canary requests answered at a step before it is judged
    gates: Gates = field(default_factory=Gates)
    # Prompts sent to both pools once a step (greedy, ``probe_tokens`` each), their answers
    # compared by the share of identical tokens (the ``probes`` gate, ``min_agreement``)
    probes: tuple[str, ...] = ()
    probe_tokens: int = 16

    def check(self, pools: Collection[str] | None = None) -> Plan:
        """This plan, or ``PlanError`` saying what is wrong (``pools``: the known ones)."""
        problems: list[str] = []
        if self.stable == self.canary:
            problems.append("stable and canary must be two pools")
        if pools is not None:
            unknown = sorted({self.stable, self.canary} - set(pools))
            if unknown:
                problems.append(f"unknown pool(s): {', '.join(unknown)}")
        steps = self.steps
        if not steps or any(not (math.isfinite(s) and 0 < s <= 100) for s in steps):
            problems.append("steps must be shares in per cent, each above 0 and at most 100")
        elif any(b <= a for a, b in itertools.pairwise(steps)) or steps[-1] != 100:
            problems.append("steps must rise, and the last be 100")
        if not (math.isfinite(self.hold_s) and self.hold_s > 0):
            problems.append("hold_s must be a number of seconds > 0")
        if self.min_requests < 0:
            problems.append("min_requests must be >= 0")
        if len(self.probes) > MAX_PROBES or any(
            not p or len(p) > MAX_PROBE_CHARS for p in self.probes
        ):
            problems.append(
                f"probes: at most {MAX_PROBES} prompts of 1 to {MAX_PROBE_CHARS} characters"
            )
        if not 1 <= self.probe_tokens <= MAX_PROBE_TOKENS:
            problems.append(f"probe_tokens must be between 1 and {MAX_PROBE_TOKENS}")
        if (self.gates.min_agreement is None) != (not self.probes):
            problems.append("probes and gates.min_agreement go together")
        problems += self.gates.problems()
        if problems:
            raise PlanError("; ".join(problems))
        return self

    def step_name(self, step: int) -> str:
        """``step`` (an index into ``steps``) as people count it: "step 1 of 3 (10 %)"."""
        return f"step {step + 1} of {len(self.steps)} ({self.steps[step]:g} %)"

    def weights(self, step: int) -> dict[str, float]:
        """The alias's weights at ``step`` (an index into ``steps``)."""
        share = self.steps[step]
        return {self.stable: 100.0 - share, self.canary: share}

    def rolled_back(self) -> dict[str, float]:
        """The alias's weights after an abort: the stable pool alone."""
        return {self.stable: 100.0, self.canary: 0.0}

    def promoted(self) -> dict[str, float]:
        """The alias's weights once promoted: the canary is its stable pool."""
        return {self.canary: 100.0}


@dataclass(frozen=True, slots=True)
class Verdict:
    action: RolloutAction
    step: int  # the step the rollout is at after acting (an index into the plan's steps)
    readings: tuple[GateReading, ...]
    why: str
    hold_left_s: float = 0.0
    requests: tuple[int, int] = (0, 0)  # the canary's and the stable pool's in the window

    @property
    def breaches(self) -> tuple[GateReading, ...]:
        return tuple(r for r in self.readings if not r.passed)

    def doc(self) -> dict[str, Any]:
        """As the admin API and the driver's replica report show it."""
        return {
            "verdict": self.action,
            "step": self.step,
            "why": self.why,
            "hold_left_s": round(self.hold_left_s, 3),
            "canary_requests": self.requests[0],
            "stable_requests": self.requests[1],
            "readings": [r.doc() for r in self.readings],
        }


def decide(
    plan: Plan,
    step: int,
    elapsed_s: float,
    canary: PoolCounts,
    stable: PoolCounts,
    *,
    agreement: float | None = None,
    paused: bool = False,
) -> Verdict:
    """What to do at ``step``, ``elapsed_s`` after it began, from both pools' counts over the
    window since then (and the probes' ``agreement``, if sent)."""
    readings = judge(canary, stable, plan.gates, agreement)
    counted = (canary.requests, stable.requests)

    def verdict(action: RolloutAction, at: int, why: str, left: float = 0.0) -> Verdict:
        return Verdict(action, at, readings, why, left, counted)

    failed = [r.gate for r in readings if not r.passed]
    enough = canary.requests >= plan.min_requests
    if failed and (enough or certain_error_breach(canary, stable, plan.gates, plan.min_requests)):
        return verdict("abort", step, f"gate(s) failed: {', '.join(failed)}")
    left = max(plan.hold_s - elapsed_s, 0.0)
    if paused:
        return verdict("hold", step, "paused", left)
    if not enough:
        return verdict(
            "hold", step, f"{canary.requests} of {plan.min_requests} canary requests", left
        )
    if left > 0:
        return verdict("hold", step, "holding", left)
    if step + 1 >= len(plan.steps):
        return verdict("promote", step, "every step passed")
    return verdict("advance", step + 1, f"{plan.step_name(step)} passed; on to step {step + 2}")
