"""Configuration of the capacity manager (``[capacity]`` in TOML; docs/capacity.md).

Off by default. Each model it manages has a rule (``[capacity.models."<model>"]``): the fields
of ``gateway.capacity.plan.Rule``, each defaulting to ``[capacity.defaults]``, then to the
rule's own default. Rules change at run time through the admin API (``PUT
/admin/capacity/{model}``), through the fleet's log like every other change.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.capacity.plan import Rule

_R: Final = Rule()


class RuleSettings(BaseModel):
    """One model's rule; every field optional (unset: the defaults')."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_awake: int | None = Field(
        None,
        ge=0,
        description=f"engines always awake ({_R.min_awake}); 0: all may sleep, "
        "a request then held while one wakes",
    )
    max_awake: int | None = Field(None, ge=0, description="most engines awake (unset: all)")
    headroom: float | None = Field(
        None, ge=0, le=10, description=f"share kept awake above the forecast ({_R.headroom})"
    )
    per_engine: float | None = Field(
        None,
        gt=0,
        description="requests (running or waiting) one engine serves within its "
        f"latency objective ({_R.per_engine:g})",
    )
    sleep_level: Literal[0, 1, 2] | None = Field(
        None,
        description="vLLM's sleep level: 1 offloads weights (wakes in seconds), 2 drops "
        f"them, 0 pauses ({_R.sleep_level})",
    )
    sleep_mode: Literal["abort", "wait", "keep"] | None = Field(
        None,
        description="what vLLM does with requests left on an engine put to sleep "
        f"({_R.sleep_mode})",
    )
    idle_before_sleep: float | None = Field(
        None,
        ge=0,
        description="seconds demand must stay below the awake engines before one "
        f"sleeps ({_R.idle_before_sleep:g})",
    )
    drain_timeout: float | None = Field(
        None,
        ge=0,
        description="seconds an engine going to sleep may finish its requests "
        f"({_R.drain_timeout:g})",
    )
    wake_time: float | None = Field(
        None,
        ge=0,
        description=f"seconds a wake takes: the forecast's look ahead ({_R.wake_time:g})",
    )
    wake_timeout: float | None = Field(
        None,
        ge=0,
        description=f"seconds a request is held while an engine wakes ({_R.wake_timeout:g})",
    )
    ttft_slo: float | None = Field(
        None, gt=0, description="time to first token (s) over which one more engine is woken"
    )
    kv_high: float | None = Field(
        None, gt=0, le=1, description=f"KV cache use over which one more is woken ({_R.kv_high})"
    )

    def given(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


def rule_of(*layers: RuleSettings | dict[str, Any]) -> Rule:
    """The rule the layers make, later ones over earlier ones, over ``Rule``'s defaults.
    ``ValueError`` if they make no valid rule."""
    doc: dict[str, Any] = {}
    for layer in layers:
        doc.update(layer.given() if isinstance(layer, RuleSettings) else layer)
    return Rule(**doc)


def rule_doc(rule: Rule) -> dict[str, Any]:
    return asdict(rule)


RULE_FIELDS: Final = frozenset(f.name for f in fields(Rule))


class CapacitySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        False,
        description="put idle engines to sleep and wake them ahead of demand "
        "(vLLM's dev-mode /sleep and /wake_up: VLLM_SERVER_DEV_MODE=1 on the engines)",
    )
    every: float = Field(1.0, gt=0, le=60, description="seconds between the manager's turns")
    lease_ttl: float = Field(
        10.0,
        gt=0,
        le=600,
        description="seconds the replica managing capacity holds the duty without renewing; "
        "another takes over after that",
    )
    trend_window: float = Field(
        30.0, gt=0, le=3600, description="seconds of demand the trend is drawn from"
    )
    sleep_poll: float = Field(
        0.25,
        gt=0,
        le=10,
        description="seconds between looks at an engine going to sleep or waking",
    )
    call_timeout: float = Field(
        120.0, gt=0, description="seconds a /sleep or /wake_up call to an engine may take"
    )
    defaults: RuleSettings = Field(default_factory=RuleSettings)
    models: dict[str, RuleSettings] = Field(
        default_factory=dict,
        description='model (or model pool) -> its rule ([capacity.models."<model>"])',
    )

    @model_validator(mode="after")
    def _rules_valid(self) -> CapacitySettings:
        for model in self.models:
            try:
                self.rule(model)
            except ValueError as exc:
                raise ValueError(f"capacity.models.{model}: {exc}") from None
        try:
            rule_of(self.defaults)
        except ValueError as exc:
            raise ValueError(f"capacity.defaults: {exc}") from None
        return self

    def rule(self, model: str) -> Rule:
        return rule_of(self.defaults, self.models.get(model, RuleSettings()))

    def rules(self) -> dict[str, Rule]:
        return {m: self.rule(m) for m in self.models}
