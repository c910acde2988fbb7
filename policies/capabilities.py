"""What a policy may offer beyond the routing contract, found once per policy.

A policy may offer **capabilities** beyond the contract (``policies.types``), each a small
Protocol here; a policy offers
one by having its members (it need not inherit from it), and the gateway uses it only through
it, never by the policy's class:

- ``FirstTokenDeadline``: how long a streamed attempt may wait for its first token before it
  is rescued (sent elsewhere); ``Hedging``: whether that rescue races a copy instead of moving
  the request, and how many copies may run at once.
- ``AffinityTuned``: tuned by an ``AffinityConfig``, which the admin API shows and patches.
- ``LatencyPredicting``: minimises predicted latency, tuned by a ``PredictionConfig``; its
  decisions are exported as metrics.
- ``ApproximatePrefix``, ``ExactPrefix``: routes on ``prefix_affinity``'s own index (its own,
  or as a fallback), or on the engines' KV events; the index's size and the decisions are
  exported as metrics.

``Capabilities.of`` finds them once, when a policy is built or swapped in; the request path
reads the record it keeps, and never probes a policy per request.

The policies that offer some are held to them by mypy at the end of this module, so the
contract's data types (``policies.types``) name no implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from policies.types import Policy

if TYPE_CHECKING:
    from collections import Counter

    from policies.kv_index import KvIndex
    from policies.precise_prefix import PrecisePrefix
    from policies.predicted_latency import PredictedLatency, PredictionConfig
    from policies.prefix_affinity import AffinityConfig, PrefixAffinity


# The optional capabilities. Runtime-checkable so that ``Capabilities.of`` can find them, once
# per policy built; their members' names are what tells them apart, so each is specific.


@runtime_checkable
class FirstTokenDeadline(Protocol):
    """Rescues a late stream: the seconds a streamed attempt on ``backend``, predicted to have
    its first token after ``predicted_ttft``, may wait for it before it is sent elsewhere
    (None: it waits, however long)."""

    def first_token_deadline(self, backend: str, predicted_ttft: float) -> float | None: ...


@runtime_checkable
class Hedging(Protocol):
    """Whether its rescue races a copy of the late stream on another backend (``hedges``)
    rather than moving it, and the share of the requests in flight such copies may be."""

    @property
    def hedges(self) -> bool: ...

    @property
    def hedge_budget(self) -> float: ...


@runtime_checkable
class AffinityTuned(Protocol):
    """Tuned by an ``AffinityConfig`` (prompt hashing, balance guard, sessions), live."""

    @property
    def affinity(self) -> AffinityConfig: ...


@runtime_checkable
class LatencyPredicting(Protocol):
    """Minimises predicted latency as its ``PredictionConfig`` says; ``decisions`` counts its
    choices by objective (and those the load guard narrowed)."""

    @property
    def prediction(self) -> PredictionConfig: ...

    @property
    def decisions(self) -> Counter[str]: ...


@runtime_checkable
class ApproximatePrefix(Protocol):
    """Routes on ``prefix_affinity``'s index of what this gateway sent where: its own, or
    the one it falls back to (``approximate``, whose index and decisions are exported)."""

    @property
    def approximate(self) -> PrefixAffinity: ...


@runtime_checkable
class ExactPrefix(Protocol):
    """Routes on the engines' own KV events (``kv_index``); ``decisions`` counts why."""

    @property
    def kv_index(self) -> KvIndex: ...

    @property
    def decisions(self) -> Counter[str]: ...


@dataclass(frozen=True, slots=True)
class Capabilities:
    """The optional capabilities one policy offers (None: not offered), found once."""

    first_token_deadline: FirstTokenDeadline | None = None
    hedging: Hedging | None = None
    affinity_tuned: AffinityTuned | None = None
    latency_predicting: LatencyPredicting | None = None
    approximate_prefix: ApproximatePrefix | None = None
    exact_prefix: ExactPrefix | None = None

    @classmethod
    def of(cls, policy: Policy) -> Capabilities:
        """What ``policy`` offers. Structural checks cost microseconds: call it when a policy
        is built or swapped in, not per request."""
        p: object = policy
        return cls(
            first_token_deadline=p if isinstance(p, FirstTokenDeadline) else None,
            hedging=p if isinstance(p, Hedging) else None,
            affinity_tuned=p if isinstance(p, AffinityTuned) else None,
            latency_predicting=p if isinstance(p, LatencyPredicting) else None,
            approximate_prefix=p if isinstance(p, ApproximatePrefix) else None,
            exact_prefix=p if isinstance(p, ExactPrefix) else None,
        )


NO_CAPABILITIES = Capabilities()


if TYPE_CHECKING:

    def _offers(
        latency: PredictedLatency, approximate: PrefixAffinity, precise: PrecisePrefix
    ) -> tuple[
        tuple[Policy, FirstTokenDeadline, Hedging, AffinityTuned, LatencyPredicting],
        tuple[Policy, AffinityTuned, ApproximatePrefix],
        tuple[Policy, AffinityTuned, ApproximatePrefix, ExactPrefix],
    ]:
        """What each offers beyond the contract, held to it by mypy."""
        return (
            (latency, latency, latency, latency, latency),
            (approximate, approximate, approximate),
            (precise, precise, precise, precise),
        )
