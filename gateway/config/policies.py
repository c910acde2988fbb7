"""Policies built from the configuration: one place turns settings into a ``Policy``."""

from __future__ import annotations

from gateway.config.declared import build
from gateway.config.routing import AffinitySettings, LatencySettings, WeightSettings
from gateway.config.settings import Settings
from policies import (
    AffinityConfig,
    KvIndex,
    LatencyConfig,
    LatencyTracker,
    Policy,
    PolicyName,
    PredictionConfig,
    Weights,
    make_policy,
)


def affinity_config(s: AffinitySettings) -> AffinityConfig:
    return build(AffinityConfig, s)


def latency_config(s: LatencySettings) -> LatencyConfig:
    return build(LatencyConfig, s)


def prediction_config(s: LatencySettings) -> PredictionConfig:
    return build(PredictionConfig, s)


def weights_of(w: WeightSettings) -> Weights:
    return build(Weights, w)


def build_policy(
    settings: Settings,
    name: PolicyName,
    weights: Weights,
    kv_index: KvIndex,
    tracker: LatencyTracker,
    *,
    previous: Policy | None = None,
    affinity: AffinityConfig | None = None,
    prediction: PredictionConfig | None = None,
) -> Policy:
    """``name`` with ``weights``, configured by ``settings`` unless ``affinity`` or
    ``prediction`` say otherwise; ``previous`` (the policy it replaces) passes on what it
    learned of prefixes."""
    return make_policy(
        name,
        weights,
        affinity=affinity or affinity_config(settings.affinity),
        previous=previous,
        kv_index=kv_index,
        kv_max_blocks=settings.kv_events.max_blocks,
        tracker=tracker,
        prediction=prediction or prediction_config(settings.latency),
    )
