"""The routing sections of the configuration: the policy's weights, prefix affinity, latency
prediction, model pools and their rollout, prefill/decode pools. Part of ``gateway.config.settings``
(whose ``Settings`` holds them); apart only to keep each module readable.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from policies import PolicyName


class WeightSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    active: float = Field(2.0, ge=0)
    queue: float = Field(3.0, ge=0)
    kv: float = Field(0.0, ge=0)


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


class AffinitySettings(BaseModel):
    """The ``prefix_affinity`` policy: prompt hashing, its index, the balance guard, sessions."""

    model_config = ConfigDict(extra="forbid")

    block_chars: int = Field(
        64, ge=8, description="prompt characters per hashed block (about 16 tokens)"
    )
    max_blocks: int = Field(128, ge=1, description="leading blocks of a prompt that are hashed")
    index_capacity: int = Field(
        50_000, ge=128, description="block hashes remembered, least recently used dropped first"
    )
    balance_abs: float = Field(
        8.0,
        ge=0,
        description="a backend one more request puts this far above the idlest loses affinity...",
    )
    balance_rel: float = Field(1.5, ge=1, description="...if also this many times above it")
    balance_on: Literal["in_flight", "score"] = Field(
        "in_flight", description="load for the guard: in-flight count or least_load score"
    )
    placement: Literal["room", "hash"] = Field(
        "room",
        description="a new prefix: least loaded, then most cache room; or hash (use with "
        "several gateway replicas, so they agree)",
    )
    session_header: str | None = Field(
        None, description="request header naming a session (e.g. x-session-id); None: off"
    )

    @model_validator(mode="after")
    def _capacity(self) -> AffinitySettings:
        if self.index_capacity < self.max_blocks:
            raise ValueError("index_capacity must be at least max_blocks")
        return self


class LatencySettings(BaseModel):
    """Learned per-backend speed (always learned) and the ``predicted_latency`` policy."""

    model_config = ConfigDict(extra="forbid")

    half_life: float = Field(
        5.0,
        gt=0,
        description="seconds for an observation's weight to halve: how fast a backend that "
        "slows down or recovers is seen",
    )
    ridge: float = Field(
        2.0, gt=0, description="observations' worth of pull toward the fleet's figures"
    )
    objective: Literal["ttft", "e2e"] = Field(
        "ttft",
        description="what predicted_latency minimises: ttft (first token) or e2e (whole "
        "answer); a key tier's objective overrides it",
    )
    explore: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="optimism for backends little observed lately: a prediction counts "
        "(1 - explore / sqrt(1 + recent observations)) of itself, so they are tried again",
    )
    balance_abs: float = Field(
        6.0,
        ge=0,
        description="predicted_latency's load guard: a backend one more request puts this far "
        "above the least loaded (least_load score)...",
    )
    balance_rel: float = Field(1.5, ge=1, description="...and this many times, is not chosen")
    slo_header: str | None = Field(
        "x-ttft-slo-ms",
        description="request header stating the TTFT the request needs, in ms (None: off); "
        "with the admission queue, a request no backend is predicted to meet waits, then is "
        "shed at priority 0",
    )
    rescue_factor: float = Field(
        3.0,
        description="predicted_latency: a streamed request with no first token this many times "
        "later than predicted is sent to another backend, once, before anything reached its "
        "client (0: never; else at least 1)",
    )
    rescue_min: float = Field(0.1, ge=0, description="...and never before this many seconds")
    rescue_mode: Literal["move", "hedge"] = Field(
        "move",
        description="how predicted_latency rescues a late stream: move (take it back and send it "
        "to another backend) or hedge (send a copy to another backend and keep the first: "
        "whichever has its first token first answers, the other is closed unsent)",
    )
    hedge_budget: float = Field(
        0.1,
        ge=0,
        le=1,
        description="hedges running at once: at most this share of the requests in flight "
        "(at least one; 0: none); a late stream over the budget waits on where it is",
    )
    prefix: Literal["none", "approximate", "precise"] = Field(
        "approximate",
        description="prefix knowledge predicted_latency uses for cached tokens: approximate "
        "(prefix_affinity's, [affinity]), precise (KV events, [kv_events]) or none",
    )

    @field_validator("rescue_factor")
    @classmethod
    def _rescue_factor(cls, v: float) -> float:
        if not (v == 0 or v >= 1):
            raise ValueError("rescue_factor must be 0 (never) or at least 1")
        return v


class PoolSettings(BaseModel):
    """A named group of configured backends serving one model (one version of it)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    model: str = Field(min_length=1, description="the model name the backends serve")
    backends: list[str] = Field(min_length=1, description="ids or URLs of [[backends]]")
    labels: dict[str, str] = Field(default_factory=dict, description="e.g. version = 'v2'")


class RolloutSettings(BaseModel):
    """How requests for an alias are split between its pools (``[aliases]``)."""

    model_config = ConfigDict(extra="forbid")

    sticky_header: str | None = Field(
        None, description="header keeping a client on one pool (e.g. x-session-id); None: off"
    )
    expose_pools: bool = Field(False, description="pool names are model names clients may use")
