"""``predicted_latency``: the backend predicted to answer soonest, from its learned speed.

``least_load`` counts requests; on a fleet that is not uniform (two GPU generations, a backend
slowed by a noisy neighbour, long and short prompts mixed) equal counts are unequal waits. This
policy asks the ``LatencyTracker`` (``policies.latency``: per-backend fits learned from the
gateway's own observations) how long each candidate would take. Each decision, in order:

1. **Balance guard**, ``prefix_affinity``'s on the ``least_load`` score (``balance_abs``,
   ``balance_rel`` of ``PredictionConfig``): a candidate far above the least loaded is not
   chosen, so a fit that is wrong (a cold start, a sudden change, a load it has never seen)
   cannot pile a burst onto one backend.
2. **Each candidate's load now**: the prompt's tokens it is not expected to hold in cache (from
   the prefix knowledge the policy is composed with: ``prefix = "approximate"``, what this
   gateway sent where; ``"precise"``, the engines' KV events; ``"none"``), the requests queued
   in its engine (scraped, plus what was sent since) and the sequences running there.
3. **The objective**, the request's own (its key's tier) or the policy's: ``ttft``, the first
   token soonest (interactive traffic); ``e2e``, the whole answer soonest (TTFT + ITL x the
   answer's tokens: its ``max_tokens``, else the mean answer seen lately).
4. **The lowest prediction** wins, each counted with some optimism where little is known of
   the backend lately (``explore``): a backend not chosen for a while (new, or slow a moment
   ago and perhaps recovered) is tried again and its figures renewed; exact ties at random.

And after the decision, **the rescue** (``first_token_deadline``): a streamed request whose
first token has not come ``rescue_factor`` times later than predicted (and at least
``rescue_min`` seconds) is taken back from its backend, before anything reached its client,
and sent to the best of the others, once (``rescue_mode = "move"``); or, with ``"hedge"``, a
copy is sent to the best of the others while the first keeps waiting, and whichever of the two
has its first token first answers (the other is ended before anything of it was sent). A
backend that slows down while requests wait in its queue (a noisy neighbour, a long prefill
ahead of them) then costs them a bounded delay instead of its whole slowness, and the wait it
had reached is learned as its TTFT (a lower bound), so it is predicted slow until it shows
otherwise.

The choice is recorded with the prefix knowledge (tentatively, as its own policy would), so a
burst of one new prefix is seen as cached where the first of it went; the ``Decision`` carries
that policy's own decision (settled by it) and the tokens the chosen backend was expected to
hold, which the latency tracker learns the attempt against.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal

from policies.latency import LatencyTracker, prompt_size
from policies.precise_prefix import PrecisePrefix
from policies.prefix_affinity import AffinityConfig, PrefixAffinity, not_overloaded
from policies.scoring import Weights
from policies.setting import check_settings, spec
from policies.types import BackendSnapshot, Decision, Needs, Outcome, Rng, RouteFacts

Objective = Literal["ttft", "e2e"]
PrefixSource = Literal["none", "approximate", "precise"]
RescueMode = Literal["move", "hedge"]
RESCUE_MODES: Final[tuple[RescueMode, ...]] = ("move", "hedge")
OBJECTIVES: Final[tuple[Objective, ...]] = ("ttft", "e2e")
PREFIX_SOURCES: Final[tuple[PrefixSource, ...]] = ("none", "approximate", "precise")
# The rescue judges "late" against what is known: not before this many recent observations
# of the backend (a new one's prediction is mostly the fleet's, and no promise).
RESCUE_MIN_WEIGHT: Final = 4.0


def rescue_declined(others: Sequence[BackendSnapshot]) -> str | None:
    """Why a late stream should stay where it is, given the backends it could go to (None:
    move it). ``no_other_backend``: none could take it. ``others_queued``: every other engine
    has requests waiting for a slot (its last scrape said so): the whole fleet is behind, not
    this backend, and moving the request would trade its place in this queue for the end of
    another. A backend with no fresh scrape counts as one that could take it."""
    if not others:
        return "no_other_backend"
    if all(o.queue_depth for o in others):
        return "others_queued"
    return None


@dataclass(frozen=True, slots=True)
class PredictionConfig:
    """What ``predicted_latency`` minimises and whose prefix knowledge it uses (live)."""

    objective: Objective = field(
        default="ttft",
        metadata=spec(
            "what predicted_latency minimises: ttft (first token) or e2e (whole answer); a key "
            "tier's objective overrides it",
        ),
    )
    prefix: PrefixSource = field(
        default="approximate",
        metadata=spec(
            "prefix knowledge predicted_latency uses for cached tokens: approximate "
            "(prefix_affinity's, [affinity]), precise (KV events, [kv_events]) or none",
        ),
    )
    # A backend that has not been chosen lately (a new one, one that was slow and may have
    # recovered) is then tried again, while one that is known to be much slower is not.
    explore: float = field(
        default=0.5,
        metadata=spec(
            "optimism for backends little observed lately: a prediction counts "
            "(1 - explore / sqrt(1 + recent observations)) of itself, so they are tried again",
            ge=0,
            lt=1,
        ),
    )
    # The fits know little of loads the policy itself avoids, so the guard keeps a backend
    # that just turned fast from taking a herd, however fast it is predicted.
    balance_abs: float = field(
        default=6.0,
        metadata=spec(
            "predicted_latency's load guard: a backend one more request puts this far above the "
            "least loaded (least_load score)...",
            ge=0,
        ),
    )
    balance_rel: float = field(
        default=1.5, metadata=spec("...and this many times, is not chosen", ge=1)
    )
    # 0 or at least 1 (checked below): a rescue must not fire before its prediction.
    rescue_factor: float = field(
        default=3.0,
        metadata=spec(
            "predicted_latency: a streamed request with no first token this many times later than "
            "predicted is sent to another backend, once, before anything reached its client "
            "(0: never; else at least 1)",
        ),
    )
    rescue_min: float = field(
        default=0.1, metadata=spec("...and never before this many seconds", ge=0)
    )
    rescue_mode: RescueMode = field(
        default="move",
        metadata=spec(
            "how predicted_latency rescues a late stream: move (take it back and send it to "
            "another backend) or hedge (send a copy to another backend and keep the first: "
            "whichever has its first token first answers, the other is closed unsent)",
        ),
    )
    hedge_budget: float = field(
        default=0.1,
        metadata=spec(
            "hedges running at once: at most this share of the requests in flight (at least one; "
            "0: none); a late stream over the budget waits on where it is",
            ge=0,
            le=1,
        ),
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if not (self.rescue_factor == 0 or self.rescue_factor >= 1):
            raise ValueError("rescue_factor must be 0 (off) or at least 1")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}")
        if self.prefix not in PREFIX_SOURCES:
            raise ValueError(f"prefix must be one of {', '.join(PREFIX_SOURCES)}")
        if self.rescue_mode not in RESCUE_MODES:
            raise ValueError(f"rescue_mode must be one of {', '.join(RESCUE_MODES)}")


@dataclass(slots=True)
class PredictedLatency:
    tracker: LatencyTracker
    weights: Weights = field(default_factory=Weights)
    rng: Rng = field(default_factory=random.Random)
    config: AffinityConfig = field(default_factory=AffinityConfig)  # prompt hashing
    prediction: PredictionConfig = field(default_factory=PredictionConfig)
    prefix: PrefixAffinity | PrecisePrefix | None = None  # None: prompts are never cached
    decisions: Counter[str] = field(default_factory=Counter)
    name: str = "predicted_latency"
    _needs: Needs = field(init=False, repr=False)
    _guard: AffinityConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        pc = self.prediction
        self._guard = replace(
            self.config, balance_on="score", balance_abs=pc.balance_abs, balance_rel=pc.balance_rel
        )
        base = self.prefix.needs if self.prefix is not None else Needs()
        self._needs = Needs(
            prefix=base.prefix,
            prefix_key=base.prefix_key,
            session_header=None,
            tokens=base.tokens,
            size=True,
        )

    @property
    def needs(self) -> Needs:
        return self._needs

    @property
    def affinity(self) -> AffinityConfig:
        """How it hashes prompts (``policies.capabilities.AffinityTuned``)."""
        return self.config

    def choose(self, facts: RouteFacts, candidates: list[BackendSnapshot]) -> Decision | None:
        if not candidates:
            return None
        eligible = not_overloaded(self._guard, self.weights, candidates)
        held = {} if self.prefix is None else self.prefix.held_tokens(facts, candidates)
        objective = facts.objective if facts.objective in OBJECTIVES else self.prediction.objective
        size = prompt_size(facts)
        answer = float(facts.max_tokens or self.tracker.mean_tokens)
        explore = self.prediction.explore
        tracker = self.tracker
        e2e = objective == "e2e"
        best: list[BackendSnapshot] = []
        best_t = float("inf")
        now = tracker.clock()
        after_first = max(0.0, answer - 1.0)
        for snap in eligible:
            b = snap.id
            load = tracker.load(snap, size, held.get(b, 0.0))
            t, itl, w = tracker.weigh(b, load, now)
            if e2e:
                t += itl * after_first
            if explore:
                t *= 1.0 - explore / math.sqrt(1.0 + w)
            if t < best_t:
                best_t, best = t, [snap]
            elif t == best_t:
                best.append(snap)
        choice = best[self.rng.randrange(len(best))] if len(best) > 1 else best[0]
        self.decisions[objective] += 1
        if len(eligible) < len(candidates):
            self.decisions["guarded"] += 1
        return Decision(choice, held.get(choice.id, 0.0), self._took(facts, choice))

    def on_result(self, facts: RouteFacts, decision: Decision, outcome: Outcome) -> None:
        """Its prefix knowledge settles the decision it recorded the choice under."""
        if self.prefix is not None:
            inner = decision.tentative
            self.prefix.on_result(
                facts, inner if isinstance(inner, Decision) else decision, outcome
            )

    def first_token_deadline(self, backend: str, predicted_ttft: float) -> float | None:
        """Seconds after sending by which a streamed request's first token must come from
        ``backend``, else it is sent to another (None: it waits, however long)."""
        factor = self.prediction.rescue_factor
        if not factor or not math.isfinite(predicted_ttft):
            return None
        if self.tracker.weight(backend) < RESCUE_MIN_WEIGHT:
            return None
        return max(self.prediction.rescue_min, factor * predicted_ttft)

    @property
    def hedge_budget(self) -> float:
        """Hedges running at once, as a share of the requests in flight."""
        return self.prediction.hedge_budget

    @property
    def hedges(self) -> bool:
        """Whether a late stream is hedged (a copy sent elsewhere) rather than moved."""
        return self.prediction.rescue_mode == "hedge"

    def _took(self, facts: RouteFacts, backend: BackendSnapshot) -> Decision | None:
        """Record the choice with the prefix knowledge, as its own policy would: its decision."""
        if isinstance(self.prefix, PrecisePrefix):
            return self.prefix.took(facts, backend)
        if self.prefix is not None:
            return self.prefix.remember(facts, backend)
        return None
