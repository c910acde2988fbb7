"""Configuration enters once: TOML file, then GATEWAY_* environment, then flags."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config.settings import Settings, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for k in list(os.environ):
        if k.startswith("GATEWAY_"):
            monkeypatch.delenv(k)


def test_backends_from_comma_separated_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_BACKENDS", "http://a:8000, http://b:8000/")
    monkeypatch.setenv("GATEWAY_POLICY", "power_of_two")
    monkeypatch.setenv("GATEWAY_WEIGHTS__QUEUE", "5")
    s = load_settings()
    assert [b.url for b in s.backends] == ["http://a:8000", "http://b:8000"]
    assert [b.id for b in s.backends] == ["a:8000", "b:8000"]
    assert s.policy == "power_of_two"
    assert s.weights.queue == 5
    assert s.weights.active == 2


def test_toml_file_then_environment_then_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "gw.toml"
    cfg.write_text(
        'port = 9000\npolicy = "round_robin"\nbackends = ["http://x:1", '
        '{ url = "http://y:2", name = "y", api_key = "sk-y" }]\n'
        "[weights]\nactive = 1.5\n[upstream]\nidle_timeout = 30\n"
    )
    s = load_settings(cfg)
    assert (s.port, s.policy, s.weights.active, s.upstream.idle_timeout) == (
        9000,
        "round_robin",
        1.5,
        30,
    )
    assert s.backends[1].id == "y"
    assert s.backends[1].api_key is not None
    assert s.backends[1].api_key.get_secret_value() == "sk-y"
    assert "sk-y" not in repr(s)
    monkeypatch.setenv("GATEWAY_PORT", "9100")
    assert load_settings(cfg).port == 9100
    assert load_settings(cfg, port=9200).port == 9200


@pytest.mark.parametrize(
    "text",
    [
        "prot = 1\n",  # unknown key
        'policy = "fastest"\n',
        'backends = ["ftp://a"]\n',
        'backends = ["http://a:1", "http://a:1"]\n',
        "[weights]\nqueue = -1\n",
    ],
)
def test_bad_config_is_refused(tmp_path: Path, text: str) -> None:
    cfg = tmp_path / "gw.toml"
    cfg.write_text(text)
    with pytest.raises(ValidationError):
        load_settings(cfg)


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "nope.toml")


def test_an_empty_admin_token_is_refused_not_taken_for_one() -> None:
    with pytest.raises(ValidationError, match=r"admin\.token is empty"):
        Settings.model_validate({"admin": {"token": " "}})
    assert Settings.model_validate({"admin": {}}).admin.token is None


ROLLOUT_FILE = """
backends = [{ url = "http://a:1", name = "a" }, { url = "http://b:1", name = "b" }]
pools = [
  { name = "v1", model = "m", backends = ["a"] },
  { name = "v2", model = "m", backends = ["b"] },
]
aliases = { chat = { v1 = 100 } }
[rollout.plans.chat]
stable = "v1"
canary = "%s"
steps = [%s]
hold_s = 60
gates = { ttft_p99_slo = 2.0 }
"""


def test_a_rollout_plan_in_the_file_is_checked_as_the_admin_api_would(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.toml"
    cfg.write_text(ROLLOUT_FILE % ("v2", "10, 100"))
    [plan] = load_settings(cfg).rollout_plans()
    assert (plan.alias, plan.canary, plan.steps, plan.hold_s) == ("chat", "v2", (10, 100), 60)
    assert plan.gates.ttft_p99_slo == 2.0
    for canary, steps, why in (
        ("v3", "10, 100", "unknown pool"),
        ("v2", "50, 10", "steps must rise"),
    ):
        cfg.write_text(ROLLOUT_FILE % (canary, steps))
        with pytest.raises(ValidationError, match=f"rollout.plans.chat: .*{why}"):
            load_settings(cfg)
    cfg.write_text((ROLLOUT_FILE % ("v2", "100")).replace("plans.chat", "plans.other"))
    with pytest.raises(ValidationError, match="no alias 'other'"):
        load_settings(cfg)
