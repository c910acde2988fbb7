"""``prefix_affinity``: send a prompt where its prefix is cached, unless that overloads anyone.

Each decision, in order:

1. **Balance guard.** A candidate that one more request would put more than ``balance_abs``
   above the least-loaded candidate's load *and* more than ``balance_rel`` times it is
   *overloaded*: it may still be chosen by load, never by affinity. This is sglang's router's
   imbalance test, applied per candidate and to the load after the choice, so routing never
   takes a backend past the spread and the rest of the fleet keeps its affinity while one
   backend is hot. Load is the gateway's own in-flight count (``balance_on="in_flight"``, the
   freshest signal; one request adds 1), or the ``least_load`` score (``"score"``, in score
   units; one request adds the ``active`` weight). The least-loaded candidate is never
   overloaded.
2. **Session affinity** (when ``session_header`` is set and the request carries it): the
   session's backend is the rendezvous-hash winner among the candidates, so sessions stay
   put and only those of a backend that leaves move. An overloaded winner falls through.
3. **Prefix affinity.** Among the candidates that are not overloaded, the ones believed to
   hold the longest prefix of the prompt (in blocks, from the policy's own ``PrefixIndex``)
   win. When several hold it, it depends on how much traffic the prefix carries
   (``PrefixHeat``: its share of recent decisions). A prefix one backend can carry (share
   at most 1 / eligible backends) stays with the backend that received it first, so the
   copy a guarded request left elsewhere is not kept warm at the cost of that cache's own
   prefixes. A hotter one is spread by the ``least_load`` score, then chance.
4. **Placement.** A prompt nobody holds goes to the least-loaded candidate; among equally
   loaded ones, to the one whose cache the index fills least (``PrefixIndex.footprint``), so
   a burst of new prefixes spreads over the caches instead of landing by chance.

The chosen backend is then recorded as holding the prompt's blocks, tentatively: a burst of
the same new prefix follows the first request at once. What the record added travels with the
``Decision`` (its ``tentative``), and the attempt's ``Outcome`` settles it: an attempt that
failed (the backend never computed the prompt, or broke) withdraws what it added; one that
succeeded records the blocks again, which also restores them if a concurrent failure on the
same backend withdrew them; one never settled stays recorded, as if it had succeeded. The index
and the heat are the only state, bounded by ``index_capacity`` block hashes (LRU) and the
heat's window; ``decisions`` counts why each choice was made.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Literal

from policies.facts import CHARS_PER_TOKEN
from policies.least_load import LeastLoad
from policies.prefix import PrefixHasher, PrefixHeat, PrefixIndex
from policies.scoring import Weights, score
from policies.setting import check_settings, spec
from policies.types import BackendSnapshot, Decision, Needs, Outcome, Rng, RouteFacts

BalanceOn = Literal["in_flight", "score"]
Placement = Literal["room", "hash"]
# Why a backend was chosen (the ``decisions`` keys).
REASONS: Final = ("session", "session_overflow", "prefix", "balance", "load")


@dataclass(frozen=True, slots=True)
class AffinityConfig:
    """Everything ``prefix_affinity`` can be tuned with (live, through the admin API)."""

    block_chars: int = field(
        default=64, metadata=spec("prompt characters per hashed block (about 16 tokens)", ge=8)
    )
    max_blocks: int = field(
        default=128, metadata=spec("leading blocks of a prompt that are hashed", ge=1)
    )
    index_capacity: int = field(
        default=50_000,
        metadata=spec("block hashes remembered, least recently used dropped first", ge=128),
    )
    balance_abs: float = field(
        default=8.0,
        metadata=spec(
            "a backend one more request puts this far above the idlest loses affinity...", ge=0
        ),
    )
    balance_rel: float = field(
        default=1.5, metadata=spec("...if also this many times above it", ge=1)
    )
    balance_on: BalanceOn = field(
        default="in_flight",
        metadata=spec("load for the guard: in-flight count or least_load score"),
    )
    placement: Placement = field(
        default="room",
        metadata=spec(
            "a new prefix: least loaded, then most cache room; or hash (use with several gateway "
            "replicas, so they agree)",
        ),
    )
    session_header: str | None = field(
        default=None,
        metadata=spec("request header naming a session (e.g. x-session-id); None: off"),
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.index_capacity < self.max_blocks:
            raise ValueError("index_capacity must be at least max_blocks")
        if self.balance_on not in ("in_flight", "score"):
            raise ValueError(f"balance_on must be in_flight or score, got {self.balance_on!r}")
        if self.placement not in ("room", "hash"):
            raise ValueError(f"placement must be room or hash, got {self.placement!r}")

    @property
    def hasher(self) -> PrefixHasher:
        return PrefixHasher(self.block_chars, self.max_blocks)

    def overloaded(self, load: float, floor: float, step: float) -> bool:
        """Would ``step`` more load put it past both thresholds above the ``floor``?

        ``floor`` is the least-loaded candidate's load, which is never overloaded.
        """
        after = load + step
        return (
            load > floor and after - floor > self.balance_abs and after > floor * self.balance_rel
        )


def not_overloaded(
    cfg: AffinityConfig, weights: Weights, candidates: list[BackendSnapshot]
) -> list[BackendSnapshot]:
    """The candidates the balance guard lets affinity choose (never empty if any are given)."""
    if cfg.balance_on == "in_flight":
        loads = [float(s.in_flight) for s in candidates]
        step = 1.0
    else:
        loads = [score(s, weights) for s in candidates]
        step = weights.active
    floor = min(loads)
    return [
        s
        for s, load in zip(candidates, loads, strict=True)
        if not cfg.overloaded(load, floor, step)
    ]


def session_target(
    facts: RouteFacts, cfg: AffinityConfig, candidates: list[BackendSnapshot]
) -> BackendSnapshot | None:
    """The session's backend (rendezvous winner among ``candidates``), if the request has one."""
    if facts.session_key is None or cfg.session_header is None:
        return None
    key = facts.session_key
    return max(candidates, key=lambda s: rendezvous(key, s.id))


def placement(
    facts: RouteFacts,
    pool: list[BackendSnapshot],
    cfg: AffinityConfig,
    weights: Weights,
    footprint: Callable[[str], int],
) -> list[BackendSnapshot]:
    """Where a prompt nobody holds may go (the caller picks one of them by load).

    ``room``: the least loaded, then the ones with the most cache room (the smallest
    ``footprint``), so a burst of new prefixes spreads over the caches evenly. ``hash``: the
    rendezvous winner for the prompt's stable key among the candidates the guard allows, so
    every gateway replica places a new prefix on the same backend.
    """
    key = facts.prefix_key
    if cfg.placement == "hash" and key is not None:
        return [max(pool, key=lambda s: rendezvous(str(key), s.id))]
    scores = [score(s, weights) for s in pool]
    floor = min(scores)
    lightest = [s for s, sc in zip(pool, scores, strict=True) if sc == floor]
    if len(lightest) > 1:
        rooms = [footprint(s.id) for s in lightest]
        least = min(rooms)
        lightest = [s for s, r in zip(lightest, rooms, strict=True) if r == least]
    return lightest


@dataclass(frozen=True, slots=True)
class _Recorded:
    """The block hashes one decision recorded its backend for, until the outcome says whether
    it took them (``Decision.tentative``)."""

    added: tuple[int, ...]


def rendezvous(key: str, backend_id: str) -> int:
    """Highest-random-weight hash: stable across processes, so every replica agrees."""
    digest = hashlib.blake2b(f"{key}\x00{backend_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(slots=True)
class PrefixAffinity:
    weights: Weights = field(default_factory=Weights)
    rng: Rng = field(default_factory=random.Random)
    config: AffinityConfig = field(default_factory=AffinityConfig)
    # Sized to config.index_capacity on construction; pass the old one to keep its memory.
    index: PrefixIndex = field(default_factory=lambda: PrefixIndex(1))
    decisions: Counter[str] = field(default_factory=Counter)
    heat: PrefixHeat = field(default_factory=PrefixHeat)
    name: str = "prefix_affinity"
    _load: LeastLoad = field(init=False, repr=False)
    _needs: Needs = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._load = LeastLoad(weights=self.weights, rng=self.rng)
        cfg = self.config
        self._needs = Needs(
            prefix=cfg.hasher,
            prefix_key=cfg.placement == "hash",
            session_header=cfg.session_header,
        )
        self.index.resize(cfg.index_capacity)

    @property
    def needs(self) -> Needs:
        """The prompt's block hashes (and its stable key under hash placement), the session."""
        return self._needs

    @property
    def affinity(self) -> AffinityConfig:
        """How it is tuned (``policies.capabilities.AffinityTuned``)."""
        return self.config

    @property
    def approximate(self) -> PrefixAffinity:
        """The index it routes on is its own (``policies.capabilities.ApproximatePrefix``)."""
        return self

    @property
    def prefix_hasher(self) -> PrefixHasher:
        """How this policy cuts prompts into blocks (a replacement keeps the index if equal)."""
        assert self._needs.prefix is not None
        return self._needs.prefix

    def choose(self, facts: RouteFacts, candidates: list[BackendSnapshot]) -> Decision | None:
        if not candidates:
            return None
        choice, reason = self._decide(facts, candidates)
        self.decisions[reason] += 1
        return self.remember(facts, choice)

    def remember(self, facts: RouteFacts, backend: BackendSnapshot) -> Decision:
        """Record ``backend`` as holding the prompt, tentatively until ``on_result`` is given
        the decision returned (also for another policy's choice: ``precise_prefix`` and
        ``predicted_latency`` keep this index warm this way)."""
        if not facts.prefix_hashes:
            return Decision(backend)
        added = self.index.record(backend.id, facts.prefix_hashes)
        return Decision(backend, tentative=_Recorded(tuple(added)))

    def held_tokens(self, facts: RouteFacts, candidates: list[BackendSnapshot]) -> dict[str, float]:
        """Per candidate, about how many of the prompt's tokens it should hold in cache: its
        matched blocks' characters, about four to a token (for ``predicted_latency``)."""
        if not facts.prefix_hashes:
            return dict.fromkeys((s.id for s in candidates), 0.0)
        held = self.index.match(facts.prefix_hashes, [s.id for s in candidates])
        per_block = self.config.block_chars / CHARS_PER_TOKEN
        return {b: n * per_block for b, n in held.items()}

    def on_result(self, facts: RouteFacts, decision: Decision, outcome: Outcome) -> None:
        """Settle the decision's tentative record: withdraw it, or confirm it."""
        if not facts.prefix_hashes:
            return
        backend, recorded = decision.backend.id, decision.tentative
        if outcome.ok:
            self.index.record(backend, facts.prefix_hashes)
        elif isinstance(recorded, _Recorded):
            self.index.withdraw(backend, recorded.added)

    def _decide(
        self, facts: RouteFacts, candidates: list[BackendSnapshot]
    ) -> tuple[BackendSnapshot, str]:
        cfg = self.config
        eligible = not_overloaded(cfg, self.weights, candidates)
        overflow = False
        target = session_target(facts, cfg, candidates)
        if target is not None:
            if any(s is target for s in eligible):
                return target, "session"
            overflow = True
        choice, reason = self._by_prefix(facts, candidates, eligible)
        return choice, "session_overflow" if overflow else reason

    def _by_prefix(
        self,
        facts: RouteFacts,
        candidates: list[BackendSnapshot],
        eligible: list[BackendSnapshot],
    ) -> tuple[BackendSnapshot, str]:
        hashes = facts.prefix_hashes
        if not hashes:
            self.heat.observe(None)
            return self._pick(facts, eligible), "load"
        held = self.index.match(hashes, [s.id for s in candidates])
        deepest = max(held.values())
        share = self.heat.observe(hashes[deepest - 1] if deepest else None)
        best = max(held[s.id] for s in eligible)
        if best == 0:
            reason = "balance" if deepest > 0 else "load"
            return self._place(facts, eligible), reason
        top = [s for s in eligible if held[s.id] == best]
        if len(top) > 1 and share * len(eligible) <= 1.0:
            # A prefix that one backend can carry stays with the backend that got it first,
            # so copies made when the guard sent it elsewhere are not kept warm.
            return self._owner(hashes[best - 1], top), "prefix"
        if deepest > best:
            reason = "balance"  # the guard passed over a longer match
        elif len(top) < len(eligible):
            reason = "prefix"
        else:
            reason = "load"  # every eligible backend holds as much
        return self._pick(facts, top), reason

    def _owner(self, block: int, top: list[BackendSnapshot]) -> BackendSnapshot:
        """Of ``top``, the backend that received ``block`` first (the index keeps that order)."""
        by_id = {s.id: s for s in top}
        for holder in self.index.holders(block):
            if holder in by_id:
                return by_id[holder]
        return top[0]

    def _place(self, facts: RouteFacts, pool: list[BackendSnapshot]) -> BackendSnapshot:
        return self._pick(
            facts, placement(facts, pool, self.config, self.weights, self.index.footprint)
        )

    def _pick(self, facts: RouteFacts, pool: list[BackendSnapshot]) -> BackendSnapshot:
        choice = self._load.choose(facts, pool)
        assert choice is not None  # pool is never empty: the least loaded is always eligible
        return choice.backend
