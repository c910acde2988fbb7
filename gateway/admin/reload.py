"""Live changes: a new policy or weights, and a re-read configuration file.

Both are validated in full before anything changes: a bad change leaves the running
configuration as it was and says why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import structlog
from pydantic import BaseModel, ConfigDict, ValidationError

from backends.errors import InvalidRequest
from backends.state import BackendSpec
from gateway.config.policies import (
    affinity_config,
    build_policy,
    latency_config,
    prediction_config,
    weights_of,
)
from gateway.config.routing import AffinitySettings, LatencySettings, WeightSettings
from gateway.config.settings import Settings
from gateway.request.services import Services
from policies import AffinityConfig, PolicyName, PredictionConfig, Weights
from policies.capabilities import Capabilities

log = structlog.get_logger("gateway.admin.reload")

# Settings that take effect without a restart.
_LIVE = frozenset(
    {"backends", "policy", "weights", "affinity", "latency", "pools", "aliases", "rollout"}
)
_POLICY_FIELDS = frozenset({"policy", "weights", "affinity", "latency"})


def live(setting: str) -> bool:
    """Whether a reload applies ``setting`` at once (else it needs a restart)."""
    return setting in _LIVE


class PolicyChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: PolicyName | None = None
    weights: WeightSettings | None = None
    # prefix_affinity's settings; only the fields given change.
    affinity: dict[str, Any] | None = None
    # [latency]: predicted_latency's objective and prefix source, the fits' half-life and
    # ridge; only the fields given change.
    latency: dict[str, Any] | None = None


def describe_policy(svc: Services) -> dict[str, Any]:
    router = svc.router
    policy, caps = router.policy, router.capabilities
    w = policy.weights
    doc: dict[str, Any] = {
        "policy": policy.name,
        "weights": None if w is None else {"active": w.active, "queue": w.queue, "kv": w.kv},
    }
    if caps.affinity_tuned is not None:
        doc["affinity"] = asdict(caps.affinity_tuned.affinity)
    if caps.latency_predicting is not None:
        cfg = svc.latency.config
        doc["latency"] = {
            **asdict(caps.latency_predicting.prediction),
            "half_life": cfg.half_life,
            "ridge": cfg.ridge,
        }
    return doc


def _affinity(svc: Services, current: Capabilities, patch: dict[str, Any] | None) -> AffinityConfig:
    """The running affinity settings (the policy's, else the configuration's), patched."""
    if current.affinity_tuned is not None:
        base = asdict(current.affinity_tuned.affinity)
    else:
        base = svc.config.current.affinity.model_dump()
    try:
        return affinity_config(AffinitySettings.model_validate({**base, **(patch or {})}))
    except ValidationError as exc:
        raise InvalidRequest(f"Invalid policy change: affinity: {_errors(exc)}") from exc


def _latency(svc: Services, current: Capabilities, patch: dict[str, Any] | None) -> LatencySettings:
    """The running [latency] settings (the policy's and tracker's, else the configuration's),
    patched."""
    base = svc.config.current.latency.model_dump()
    if current.latency_predicting is not None:
        base.update(asdict(current.latency_predicting.prediction))
    cfg = svc.latency.config
    base.update(half_life=cfg.half_life, ridge=cfg.ridge)
    try:
        return LatencySettings.model_validate({**base, **(patch or {})})
    except ValidationError as exc:
        raise InvalidRequest(f"Invalid policy change: latency: {_errors(exc)}") from exc


def _needs_events(name: str, prediction: PredictionConfig) -> bool:
    return name == "precise_prefix" or (
        name == "predicted_latency" and prediction.prefix == "precise"
    )


def _refuse_untracked_events() -> None:
    raise InvalidRequest(
        "Invalid policy change: precise_prefix (and predicted_latency with prefix = "
        "precise) routes on the backends' KV events, which "
        "this gateway does not follow: set [kv_events] enabled = true and restart."
    )


@dataclass(frozen=True, slots=True)
class PolicyPlan:
    """A policy change checked in full against the running state, not yet made."""

    name: PolicyName
    weights: Weights
    affinity: AffinityConfig
    latency: LatencySettings
    prediction: PredictionConfig


def plan_policy(svc: Services, body: Any) -> PolicyPlan:
    """Check a policy change; ``InvalidRequest`` if bad. Changes nothing."""
    try:
        change = PolicyChange.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(f"Invalid policy change: {_errors(exc)}") from exc
    current = svc.router.policy
    name: PolicyName = change.policy or current.name  # type: ignore[assignment]
    if change.weights is not None:
        w = change.weights
        weights = weights_of(w)
    else:
        weights = current.weights or Weights()
    caps = svc.router.capabilities
    affinity = _affinity(svc, caps, change.affinity)
    latency = _latency(svc, caps, change.latency)
    prediction = prediction_config(latency)
    if _needs_events(name, prediction) and svc.kv_feeds is None:
        _refuse_untracked_events()
    return PolicyPlan(name, weights, affinity, latency, prediction)


def change_policy(svc: Services, body: Any) -> dict[str, Any]:
    """Switch policy and/or weights; raises ``InvalidRequest`` and changes nothing if bad."""
    plan = plan_policy(svc, body)
    old = describe_policy(svc)
    svc.latency.configure(latency_config(plan.latency))
    svc.router.policy = build_policy(
        svc.config.current,
        plan.name,
        plan.weights,
        svc.kv_index,
        svc.latency,
        previous=svc.router.policy,
        affinity=plan.affinity,
        prediction=plan.prediction,
    )
    new = describe_policy(svc)
    svc.metrics.policy_changes.inc()
    log.info("policy_changed", old=old, new=new)
    return new


@dataclass
class ReloadResult:
    applied: list[str] = field(default_factory=list)
    restart_required: list[str] = field(default_factory=list)


def read_settings(svc: Services) -> Settings:
    """The configuration as the file and environment give it now; ``InvalidRequest`` if bad."""
    try:
        return svc.config.load()
    except (ValidationError, ValueError, OSError) as exc:
        detail = _errors(exc) if isinstance(exc, ValidationError) else str(exc)
        log.warning("reload_refused", reason=detail)
        raise InvalidRequest(f"Configuration not reloaded: {detail}") from exc


def reload_settings(svc: Services) -> ReloadResult:
    """Re-read the configuration; apply what can change live, list what needs a restart."""
    new = read_settings(svc)
    old = svc.config.current
    result = ReloadResult()
    for name in type(new).model_fields:
        if getattr(old, name) != getattr(new, name):
            applies = name in _LIVE or (name == "capacity" and _rules_only(old, new))
            (result.applied if applies else result.restart_required).append(name)
    if _needs_events(new.policy, prediction_config(new.latency)) and svc.kv_feeds is None:
        _refuse_untracked_events()
    if _POLICY_FIELDS & set(result.applied):
        svc.latency.configure(latency_config(new.latency))
        svc.router.policy = build_policy(
            new.model_copy(update={"kv_events": old.kv_events}),  # max_blocks needs a restart
            new.policy,
            weights_of(new.weights),
            svc.kv_index,
            svc.latency,
            previous=svc.router.policy,
        )
    if "backends" in result.applied:
        _apply_backends(svc, new)
    if "capacity" in result.applied:
        _apply_capacity_rules(svc, new)
    # A change of [rollout.plans] alone is the driver's to read (``gateway.rollouts``); the
    # weights of an alias a rollout is moving stay the rollout's.
    routing = {"pools", "aliases"} & set(result.applied) or old.rollout.model_dump(
        exclude={"plans"}
    ) != new.rollout.model_dump(exclude={"plans"})
    if routing:
        owned = [run.plan.alias for run in svc.rollouts.now.active()]
        svc.rollout.reconfigure(new, owned)
        svc.metrics.known_pools(svc.rollout.pairs())
    # What needs a restart keeps its running value until then.
    svc.config.current = old.model_copy(update={k: getattr(new, k) for k in result.applied})
    log.info("config_reloaded", applied=result.applied, restart_required=result.restart_required)
    return result


def _rules_only(old: Settings, new: Settings) -> bool:
    """Only ``[capacity]``'s rules changed (live); its other fields need a restart."""
    rules = {"models", "defaults"}
    return old.capacity.model_dump(exclude=rules) == new.capacity.model_dump(exclude=rules)


def _apply_capacity_rules(svc: Services, new: Settings) -> None:
    """The file's rules, over those set at run time (as the policy's are); the engines of a
    model no longer managed wanted awake."""
    book, pool = svc.capacity, svc.pool
    rules = new.capacity.rules()
    for model in set(book.rules) - set(rules):
        for b in pool.serving(model):
            pool.set_sleep_wanted(b.id, False)
    book.rules = rules


def _apply_backends(svc: Services, new: Settings) -> None:
    pool, monitor = svc.pool, svc.monitor
    wanted = {spec.id: spec for spec in backend_specs(new)}
    for b in pool.all():
        if b.spec.source == "static" and b.id not in wanted:
            monitor.unwatch(b.id)
            pool.remove(b.id)
    for spec in wanted.values():
        monitor.watch(pool.add(spec))
    for conf in new.backends:
        pool.set_draining(conf.id, conf.drain)


def backend_specs(settings: Settings) -> list[BackendSpec]:
    return [
        BackendSpec(
            id=b.id,
            url=b.url,
            api_key=b.api_key.get_secret_value() if b.api_key else None,
            role=b.role,
            scheduling=b.scheduling,
        )
        for b in settings.backends
    ]


def _errors(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
    )
