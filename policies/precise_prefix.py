"""``precise_prefix``: send a prompt to the backend whose engine really holds its longest prefix.

Where ``prefix_affinity`` guesses what each backend caches from what this gateway sent it,
this policy reads it from the engines' own KV-cache events (``policies.kv_index``, fed by
``backends.kv.feed``): evictions, preemptions, restarts and what other gateway replicas sent
are all in it. Each decision, in order:

1. **Exact or not.** The prompt's token ids (the model's own tokenizer, ``Needs.tokens``) are
   cut into blocks of each candidate's block size and keyed as the engines' events are. If
   the prompt has no tokens (no tokenizer for the model, a request that cannot be tokenized
   faithfully) or a candidate's events are not live, the decision is ``prefix_affinity``'s
   (``fallback``, whose approximate index is kept warm on every decision), counted in
   ``decisions`` as ``fallback_no_tokens`` or ``fallback_not_live``.
2. **Balance guard and sessions**, exactly as ``prefix_affinity``'s: an overloaded backend is
   never chosen for its cache, a session stays on its rendezvous backend.
3. **Longest cached prefix** among the guarded candidates, in tokens an engine can serve from
   cache (vLLM always computes the prompt's last token); ties by the ``least_load`` score.
   ``balance`` when the guard passed over a longer match.
4. **Placement.** A prompt nobody holds goes to the least-loaded candidate, then to the one
   whose cache holds the fewest blocks (the most room for a new prefix); under ``placement =
   "hash"`` to the rendezvous winner of its stable key, so replicas agree at once.

Between the choice and the engine's first ``BlockStored`` for it (the prompt's prefill), a
burst of the same new prefix would see no holder: the chosen backend is therefore credited
with the prompt's blocks, *tentatively*, until the attempt's ``Outcome`` arrives. The
``Decision`` carries the credit's ticket (and ``prefix_affinity``'s own decision, which keeps
its index warm); ``on_result`` takes the credit back by that ticket. Credits whose outcome
never comes (a decision dropped on the way) are bounded: past ``_TENTATIVE_MAX`` the oldest is
taken back. State: the shared ``KvIndex`` (owned by the app, kept across policy changes), the
tentative credits, the fallback and the decision counts.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Final

from policies.kv_index import KvIndex, cacheable_blocks, chain_keys
from policies.least_load import LeastLoad
from policies.prefix_affinity import (
    AffinityConfig,
    PrefixAffinity,
    not_overloaded,
    placement,
    session_target,
)
from policies.scoring import Weights
from policies.setting import check_settings, spec
from policies.types import BackendSnapshot, Decision, Needs, Outcome, Rng, RouteFacts

REASONS: Final = (
    "prefix",
    "balance",
    "load",
    "session",
    "session_overflow",
    "fallback_no_tokens",
    "fallback_not_live",
)
# Credits whose outcome is awaited; past this, the oldest is taken back (its outcome lost).
_TENTATIVE_MAX: Final = 65_536
# Leading blocks of a prompt that are keyed by default: 16k tokens at vLLM's block size.
MAX_BLOCKS: Final = 1024


@dataclass(frozen=True, slots=True)
class _Credit:
    """What one decision assumed until its outcome (``Decision.tentative``): its credit's
    ticket (None: nothing credited) and the decision ``prefix_affinity`` recorded it under."""

    ticket: int | None
    approximate: Decision


@dataclass(slots=True)
class PrecisePrefix:
    index: KvIndex
    weights: Weights = field(default_factory=Weights)
    rng: Rng = field(default_factory=random.Random)
    config: AffinityConfig = field(default_factory=AffinityConfig)
    max_blocks: int = field(
        default=MAX_BLOCKS, metadata=spec("leading blocks of a prompt that are keyed", ge=1)
    )
    # The block size assumed for a backend that has not reported one yet (no event so far),
    # so that tentative credit works on a fresh fleet too. vLLM's default is 16.
    default_block_size: int = 16
    fallback: PrefixAffinity | None = None
    decisions: Counter[str] = field(default_factory=Counter)
    name: str = "precise_prefix"
    _load: LeastLoad = field(init=False, repr=False)
    _needs: Needs = field(init=False, repr=False)
    # ticket -> (backend, the keys credited to it), oldest first
    _tentative: OrderedDict[int, tuple[str, list[int]]] = field(init=False, repr=False)
    _tickets: Iterator[int] = field(init=False, repr=False)
    _credit: dict[str, Counter[int]] = field(init=False, repr=False)  # backend -> key -> n

    def __post_init__(self) -> None:
        check_settings(self)
        if self.default_block_size < 1:
            raise ValueError("default_block_size must be at least 1")
        self._load = LeastLoad(weights=self.weights, rng=self.rng)
        if self.fallback is None:
            self.fallback = PrefixAffinity(weights=self.weights, rng=self.rng, config=self.config)
        cfg = self.config
        self._needs = Needs(
            prefix=cfg.hasher,
            prefix_key=cfg.placement == "hash",
            session_header=cfg.session_header,
            tokens=True,
        )
        self._tentative = OrderedDict()
        self._tickets = itertools.count()
        self._credit = {}

    @property
    def needs(self) -> Needs:
        return self._needs

    @property
    def approximate(self) -> PrefixAffinity:
        """Its fallback (``policies.capabilities.ApproximatePrefix``)."""
        assert self.fallback is not None
        return self.fallback

    @property
    def affinity(self) -> AffinityConfig:
        """How it is tuned (``policies.capabilities.AffinityTuned``)."""
        return self.config

    @property
    def kv_index(self) -> KvIndex:
        """The engines' KV events it routes on (``policies.capabilities.ExactPrefix``)."""
        return self.index

    def choose(self, facts: RouteFacts, candidates: list[BackendSnapshot]) -> Decision | None:
        if not candidates:
            return None
        tokens = facts.prompt_tokens
        if tokens is None or not all(self.index.exact(c.id) for c in candidates):
            self.decisions["fallback_no_tokens" if tokens is None else "fallback_not_live"] += 1
            return self.approximate.choose(facts, candidates)  # settled by it, as it is
        choice, reason, keys = self._decide(facts, tokens, candidates)
        self.decisions[reason] += 1
        return self._credit_tentatively(facts, choice, keys)

    def on_result(self, facts: RouteFacts, decision: Decision, outcome: Outcome) -> None:
        """Take back the decision's credit (the engine's own events say what it holds now)
        and let the fallback settle its record."""
        credit = decision.tentative
        if isinstance(credit, _Credit):
            if credit.ticket is not None:
                entry = self._tentative.pop(credit.ticket, None)
                if entry is not None:
                    self._uncredit(*entry)
            decision = credit.approximate
        self.approximate.on_result(facts, decision, outcome)

    def held_tokens(self, facts: RouteFacts, candidates: list[BackendSnapshot]) -> dict[str, float]:
        """Per candidate, how many of the prompt's tokens its engine should serve from cache
        (with tentative credit); ``prefix_affinity``'s estimate when not exact (no tokens, or
        a candidate's events not live). For ``predicted_latency``."""
        tokens = facts.prompt_tokens
        if tokens is None or not all(self.index.exact(c.id) for c in candidates):
            return self.approximate.held_tokens(facts, candidates)
        cached, _keys_of = self._cached_tokens(tokens, candidates)
        return {b: float(n) for b, n in cached.items()}

    def took(self, facts: RouteFacts, backend: BackendSnapshot) -> Decision:
        """Another policy sent the prompt to ``backend``: credit it as ``choose`` would, until
        ``on_result`` is given the decision returned."""
        tokens = facts.prompt_tokens
        keys: list[int] = []
        if tokens is not None:
            keys = chain_keys(tokens, self._block_size(backend.id), self.max_blocks)
        return self._credit_tentatively(facts, backend, keys)

    def predicted(self, tokens: list[int] | tuple[int, ...], backend: str) -> int:
        """How many of ``tokens`` ``backend``'s engine should serve from its cache now."""
        bs = self.index.block_size(backend)
        if bs is None:
            return 0
        keys = chain_keys(tokens, bs, self.max_blocks)
        held = self.index.match(keys, [backend])[backend]
        return min(held, cacheable_blocks(len(tokens), bs)) * bs

    # -- the exact decision ----------------------------------------------------------------

    def _decide(
        self, facts: RouteFacts, tokens: tuple[int, ...], candidates: list[BackendSnapshot]
    ) -> tuple[BackendSnapshot, str, list[int]]:
        cached, keys_of = self._cached_tokens(tokens, candidates)
        eligible = not_overloaded(self.config, self.weights, candidates)
        target = session_target(facts, self.config, candidates)
        overflow = False
        if target is not None:
            if any(s is target for s in eligible):
                return target, "session", keys_of(target.id)
            overflow = True
        best = max(cached[s.id] for s in eligible)
        if best > 0:
            top = [s for s in eligible if cached[s.id] == best]
            choice = self._pick(facts, top)
            deepest = max(cached.values())
            reason = "balance" if deepest > best else "prefix"
        else:
            choice = self._place(facts, eligible)
            reason = "balance" if max(cached.values()) > 0 else "load"
        return choice, "session_overflow" if overflow else reason, keys_of(choice.id)

    def _cached_tokens(
        self, tokens: tuple[int, ...], candidates: list[BackendSnapshot]
    ) -> tuple[dict[str, int], Callable[[str], list[int]]]:
        """Per candidate, the prompt's tokens its engine holds (exact, plus tentative credit)."""
        by_size: dict[int, list[str]] = {}
        for c in candidates:
            bs = self._block_size(c.id)
            by_size.setdefault(bs, []).append(c.id)
        keys: dict[int, list[int]] = {}
        cached: dict[str, int] = {}
        size_of: dict[str, int] = {}
        for bs, ids in by_size.items():
            ks = keys[bs] = chain_keys(tokens, bs, self.max_blocks)
            limit = cacheable_blocks(len(tokens), bs)
            for b, held in self.index.match(ks, ids).items():
                cached[b] = min(max(held, self._credited(b, ks)), limit) * bs
                size_of[b] = bs

        def keys_of(backend: str) -> list[int]:
            bs = size_of.get(backend) or self._block_size(backend)
            if bs not in keys:
                keys[bs] = chain_keys(tokens, bs, self.max_blocks)
            return keys[bs]

        return cached, keys_of

    def _block_size(self, backend: str) -> int:
        return self.index.block_size(backend) or self.default_block_size

    def _place(self, facts: RouteFacts, pool: list[BackendSnapshot]) -> BackendSnapshot:
        # Room is the blocks the engine reports holding; under hash placement replicas
        # agree where a new prefix goes before any engine has reported it.
        where = placement(facts, pool, self.config, self.weights, self.index.blocks)
        return self._pick(facts, where)

    def _pick(self, facts: RouteFacts, pool: list[BackendSnapshot]) -> BackendSnapshot:
        choice = self._load.choose(facts, pool)
        assert choice is not None
        return choice.backend

    # -- tentative credit ------------------------------------------------------------------

    def _credit_tentatively(
        self, facts: RouteFacts, backend: BackendSnapshot, keys: list[int]
    ) -> Decision:
        """Credit ``backend`` with ``keys`` and the fallback's index with the prompt, both until
        the outcome of the decision returned."""
        ticket = None
        if keys:
            ticket = next(self._tickets)
            self._credit.setdefault(backend.id, Counter()).update(keys)
            self._tentative[ticket] = (backend.id, keys)
            if len(self._tentative) > _TENTATIVE_MAX:
                _oldest, (old_backend, old_keys) = self._tentative.popitem(last=False)
                self._uncredit(old_backend, old_keys)
        warm = self.approximate.remember(facts, backend)  # its guesses kept warm, as if it chose
        return Decision(backend, tentative=_Credit(ticket, warm))

    def _uncredit(self, backend: str, keys: list[int]) -> None:
        credit = self._credit.get(backend)
        if credit is None:
            return
        credit.subtract(keys)
        for k in keys:
            if credit.get(k, 0) <= 0:
                credit.pop(k, None)
        if not credit:
            del self._credit[backend]

    def _credited(self, backend: str, keys: list[int]) -> int:
        credit = self._credit.get(backend)
        if not credit:
            return 0
        n = 0
        for k in keys:
            if k not in credit:
                break
            n += 1
        return n
