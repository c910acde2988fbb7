"""Configuration of API keys, rate limits and the admission queue (``[limits]`` in TOML).

Mounted by the gateway's ``Settings`` as ``limits: LimitsSettings``; environment variables then
reach it as ``GATEWAY_LIMITS__STORE=redis``, ``GATEWAY_LIMITS__REDIS__URL=...`` and so on.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    SecretStr,
    field_validator,
    model_validator,
)

_HASH: Final = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")


class TierSettings(BaseModel):
    """What one class of client may use. ``None`` means unlimited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_minute: int | None = Field(None, gt=0)
    tokens_per_minute: int | None = Field(
        None, gt=0, description="prompt + completion tokens, reserved at admission"
    )
    max_concurrent: int | None = Field(None, gt=0, description="requests in flight at once")
    max_priority: int = Field(
        0, description="highest admission priority this tier may ask for with the header"
    )
    priority: int = Field(
        0,
        ge=-100,
        description="this tier's requests' priority when they do not ask for one (below 0: "
        "batch-class); higher goes first, in the admission queue and on engines that schedule "
        "by priority",
    )
    max_wait: float | None = Field(
        None,
        gt=0,
        description="seconds this tier's requests may wait in the admission queue (at most "
        "the queue's max_wait); one whose predicted wait is longer is refused at once (429 "
        "shed_by_priority, with Retry-After)",
    )
    own_engine_priority: bool = Field(
        False,
        description="the tier's clients may set vLLM's priority themselves (a body `priority`, "
        "an X-Vllm-Priority header); otherwise the gateway's is what the engines get",
    )
    objective: Literal["ttft", "e2e"] | None = Field(
        None,
        description="what predicted_latency minimises for this tier's requests: ttft "
        "(interactive) or e2e (batch); None: the policy's [latency] objective",
    )
    tokens_per_day: int | None = Field(
        None, gt=0, description="each key of the tier: tokens a UTC day (its own budget first)"
    )
    tokens_per_month: int | None = Field(
        None, gt=0, description="each key of the tier: tokens a UTC month"
    )

    @model_validator(mode="after")
    def _priority_within_its_max(self) -> TierSettings:
        # A priority above max_priority would be clamped to it: priority = 10 alone would
        # run at 0, silently. Say so instead.
        if self.priority > self.max_priority:
            raise ValueError(
                f"priority {self.priority} is above max_priority {self.max_priority} (which "
                f"bounds it too): set max_priority = {self.priority} or more"
            )
        return self


class KeySettings(BaseModel):
    """One API key, by its hash (``llm-gateway keys hash`` prints it); never the key itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="who the key belongs to; logs and limits use it")
    hash: str = Field(description="sha256 of the key, hex, optionally prefixed 'sha256:'")
    tier: str = "default"
    labels: dict[str, str] = Field(default_factory=dict, description="free-form, e.g. team")
    expires_at: datetime | None = Field(None, description="refused from then on (ISO 8601)")
    tokens_per_day: int | None = Field(None, gt=0, description="the key's own daily budget")
    tokens_per_month: int | None = Field(None, gt=0, description="the key's own monthly budget")
    limits: dict[
        Literal["requests_per_minute", "tokens_per_minute", "max_concurrent"], PositiveInt
    ] = Field(
        default_factory=dict,
        description="the key's own limits over its tier's (what POST /admin/keys sets)",
    )

    @field_validator("hash")
    @classmethod
    def _is_sha256(cls, v: str) -> str:
        m = _HASH.match(v.strip().lower())
        if m is None:
            raise ValueError("key hash must be 64 hex digits (sha256), optionally 'sha256:...'")
        return m.group(1)


class RedisSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    key_prefix: str = "llm-gateway:limits:"
    timeout: float = Field(
        0.05, gt=0, description="seconds per Redis call before the failure mode applies"
    )
    max_connections: int = Field(
        32,
        ge=1,
        description="connections to Redis per gateway process, all opened at start (a first "
        "burst must not spend its timeout connecting); calls beyond wait for a free one",
    )
    failure_mode: Literal["open", "closed"] = Field(
        "open", description="when Redis is down: admit without limits, or answer 503"
    )
    retry_interval: float = Field(
        0.5, ge=0, description="after a failure, seconds before Redis is tried again"
    )
    slot_ttl: float = Field(
        900.0,
        gt=0,
        description="seconds after which a concurrency slot a crashed gateway held comes back",
    )
    max_backlog: int = Field(
        10_000,
        ge=0,
        description="ended requests whose slot release and token correction wait for Redis"
        " to answer again after a blip (oldest dropped first; their slots expire)",
    )


class AdmissionSettings(BaseModel):
    """The gateway-side queue used when every routable backend is saturated."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    max_size: int = Field(1000, ge=0, description="requests waiting at once; more get a 503")
    max_wait: float = Field(30.0, gt=0, description="seconds a request may wait")
    retry_after: int = Field(1, ge=0, description="Retry-After sent with the queue's 503")
    priority_header: str = "x-priority"
    # A backend is saturated when any configured threshold is reached; the fleet is saturated
    # when every routable backend is. No threshold configured: never saturated.
    max_queue_depth: int | None = Field(
        None, ge=0, description="requests waiting inside vLLM (scraped)"
    )
    max_kv_usage: float | None = Field(
        None, gt=0, le=1, description="KV cache usage fraction (scraped)"
    )
    max_in_flight: int | None = Field(
        None, gt=0, description="requests the gateway has in flight to the backend"
    )


class LimitsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    auth: bool = Field(
        False, description="require an API key; without one, every client is anonymous"
    )
    tiers: dict[str, TierSettings] = Field(default_factory=lambda: {"default": TierSettings()})
    anonymous_tier: str = Field(
        "default",
        description="tier of unauthenticated clients when auth is off (unused with "
        "auth on: keys may then all be made at run time, through the admin API)",
    )
    keys: list[KeySettings] = Field(default_factory=list)
    store: Literal["memory", "redis"] = "memory"
    redis: RedisSettings = Field(default_factory=RedisSettings)
    default_max_tokens: int = Field(
        1024, gt=0, description="completion tokens reserved when a request sets no max_tokens"
    )
    chars_per_token: float = Field(4.0, gt=0, description="prompt estimate: characters per token")
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)

    @model_validator(mode="after")
    def _consistent(self) -> LimitsSettings:
        if not self.auth and self.anonymous_tier not in self.tiers:  # with auth: nobody's
            raise ValueError(f"anonymous_tier {self.anonymous_tier!r} is not in tiers")
        names: set[str] = set()
        hashes: set[str] = set()
        for k in self.keys:
            if k.tier not in self.tiers:
                raise ValueError(f"key {k.name!r} has unknown tier {k.tier!r}")
            if k.name in names:
                raise ValueError(f"key name {k.name!r} is listed twice")
            if k.hash in hashes:
                raise ValueError(f"key {k.name!r} has the same hash as another key")
            names.add(k.name)
            hashes.add(k.hash)
        return self
