"""The rollout bench's parts that can drift from the gateway: the configuration it writes for
each replica is one the gateway accepts, and its plan one the admin API takes."""

from __future__ import annotations

from pathlib import Path

from gateway.config.settings import load_settings
from gateway.rollouts.state import parse_plan
from loadtest.bench.rollout import ALIAS, PLAN, _config


def test_the_replicas_configuration_and_the_plan_are_the_gateways(tmp_path: Path) -> None:
    sims = {"s1": "http://127.0.0.1:1", "s2": "http://127.0.0.1:2", "c1": "http://127.0.0.1:3"}
    path = tmp_path / "r0.toml"
    path.write_text(_config(sims, "redis://127.0.0.1:6379/0", "p:", ports=(8080, 8081), name="r0"))
    settings = load_settings(path)
    assert settings.fleet_store == "redis"
    assert {p.name for p in settings.pools} == {"stable", "canary"}
    assert settings.aliases[ALIAS] == {"stable": 100, "canary": 0}
    plan = parse_plan(PLAN, ALIAS).check({p.name: p for p in settings.pools})
    assert plan.steps[-1] == 100
