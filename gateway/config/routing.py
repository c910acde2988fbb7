"""The routing sections of the configuration: the policy's weights, prefix affinity, latency
prediction, model pools and their rollout, prefill/decode pools. Part of ``gateway.config.settings``
(whose ``Settings`` holds them); apart only to keep each module readable.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.config.declared import Section, declared
from policies import AffinityConfig, LatencyConfig, PolicyName, PredictionConfig, Weights
from policies.predicted_latency import Objective, PrefixSource, RescueMode
from policies.prefix_affinity import BalanceOn, Placement


class WeightSettings(Section):
    builds = ((Weights, ""),)

    active: float = declared(Weights, "active")
    queue: float = declared(Weights, "queue")
    kv: float = declared(Weights, "kv")


class RolePoolSettings(BaseModel):
    """How one role pool (prefill or decode backends) is routed."""

    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = "least_load"
    weights: WeightSettings = Field(default_factory=WeightSettings)


class DisaggSettings(BaseModel):
    """Disaggregated prefill/decode: a model served by backends with role ``prefill`` and
    backends with role ``decode`` is answered in two steps, prefill then decode.

    Prefill is compute-bound: its pool favours short engine queues (and, with
    ``prefix_affinity``, a cached prefix; ``[affinity]`` configures it). Decode is
    memory-bound: its pool favours few streams in flight and free KV cache.
    """

    model_config = ConfigDict(extra="forbid")

    prefill: RolePoolSettings = Field(
        default_factory=lambda: RolePoolSettings(
            weights=WeightSettings(active=1.0, queue=4.0, kv=0.0)
        )
    )
    decode: RolePoolSettings = Field(
        default_factory=lambda: RolePoolSettings(
            weights=WeightSettings(active=3.0, queue=1.0, kv=4.0)
        )
    )


class AffinitySettings(Section):
    """The ``prefix_affinity`` policy: prompt hashing, its index, the balance guard, sessions."""

    builds = ((AffinityConfig, ""),)

    block_chars: int = declared(AffinityConfig, "block_chars")
    max_blocks: int = declared(AffinityConfig, "max_blocks")
    index_capacity: int = declared(AffinityConfig, "index_capacity")
    balance_abs: float = declared(AffinityConfig, "balance_abs")
    balance_rel: float = declared(AffinityConfig, "balance_rel")
    balance_on: BalanceOn = declared(AffinityConfig, "balance_on")
    placement: Placement = declared(AffinityConfig, "placement")
    session_header: str | None = declared(AffinityConfig, "session_header")


class LatencySettings(Section):
    """Learned per-backend speed (always learned) and the ``predicted_latency`` policy."""

    builds = ((LatencyConfig, ""), (PredictionConfig, ""))

    half_life: float = declared(LatencyConfig, "half_life")
    ridge: float = declared(LatencyConfig, "ridge")
    objective: Objective = declared(PredictionConfig, "objective")
    explore: float = declared(PredictionConfig, "explore")
    balance_abs: float = declared(PredictionConfig, "balance_abs")
    balance_rel: float = declared(PredictionConfig, "balance_rel")
    slo_header: str | None = Field(
        "x-ttft-slo-ms",
        description="request header stating the TTFT the request needs, in ms (None: off); "
        "with the admission queue, a request no backend is predicted to meet waits, then is "
        "shed at priority 0",
    )
    rescue_factor: float = declared(PredictionConfig, "rescue_factor")
    rescue_min: float = declared(PredictionConfig, "rescue_min")
    rescue_mode: RescueMode = declared(PredictionConfig, "rescue_mode")
    hedge_budget: float = declared(PredictionConfig, "hedge_budget")
    prefix: PrefixSource = declared(PredictionConfig, "prefix")


class PoolSettings(BaseModel):
    """A named group of configured backends serving one model (one version of it)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    model: str = Field(min_length=1, description="the model name the backends serve")
    backends: list[str] = Field(min_length=1, description="ids or URLs of [[backends]]")
    labels: dict[str, str] = Field(default_factory=dict, description="e.g. version = 'v2'")
    drain: bool = Field(False, description="start drained: no new requests through its aliases")


class RolloutSettings(BaseModel):
    """How requests for an alias are split between its pools (``[aliases]``)."""

    model_config = ConfigDict(extra="forbid")

    sticky_header: str | None = Field(
        None, description="header keeping a client on one pool (e.g. x-session-id); None: off"
    )
    expose_pools: bool = Field(False, description="pool names are model names clients may use")
    drive_every: float = Field(
        1.0,
        gt=0,
        le=60,
        description="seconds between a progressive rollout's looks at its gates "
        "(POST /admin/rollouts/{alias})",
    )
    lease_ttl: float = Field(
        10.0,
        gt=0,
        le=600,
        description="seconds a replica driving a rollout holds it without renewing; "
        "another takes over after that",
    )
    plans: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="alias -> a progressive rollout's plan ([rollout.plans.<alias>]: stable, "
        "canary, steps, hold_s, min_requests, gates, probes), started once for the fleet "
        "(again only once changed), as POST /admin/rollouts/{alias} would",
    )
