"""deploy/gateway.production.toml: every feature on, valid, and free of secrets."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from gateway.config.settings import load_settings

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "gateway.production.toml"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("GATEWAY_"):
            monkeypatch.delenv(name)


@pytest.mark.usefixtures("clean_env")
def test_the_production_configuration_turns_every_feature_on() -> None:
    s = load_settings(CONFIG)
    assert s.limits.auth
    assert len({k.tier for k in s.limits.keys}) == 3
    assert s.limits.store == "redis"
    assert s.limits.admission.enabled
    assert s.limits.admission.max_queue_depth is not None
    assert s.policy == "prefix_affinity"
    assert s.affinity.placement == "hash"  # replicas agree on placement
    assert s.aliases["chat"] == {"stable": 95.0, "canary": 5.0}
    assert {p.name for p in s.pools} == {"stable", "canary"}
    assert s.tracing.otlp_endpoint
    assert s.admin.port != s.port
    assert s.admin.token is None  # never in the file: GATEWAY_ADMIN__TOKEN
    assert s.continuation.enabled
    assert s.health.stall_after > 0


def test_its_example_keys_are_the_ones_it_documents(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN__TOKEN", "from-the-environment")
    s = load_settings(CONFIG)
    assert s.admin.token is not None
    assert s.admin.token.get_secret_value() == "from-the-environment"
    text = CONFIG.read_text()
    for example in ("sk-prod-interactive-example", "sk-prod-batch-example"):
        digest = hashlib.sha256(example.encode()).hexdigest()
        assert digest in {k.hash for k in s.limits.keys}
        assert example in text  # named in the comment, as what the hashes stand for
