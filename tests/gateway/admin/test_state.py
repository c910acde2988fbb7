"""The running state written into the configuration file (``gateway.config.export``): pure."""

from __future__ import annotations

import tomllib
from dataclasses import replace

from gateway.capacity.plan import Rule
from gateway.capacity.settings import rule_doc
from gateway.config.export import REDACTED, Running, key_entry, running_toml
from gateway.config.settings import Settings

FILE = """# Our gateway: edit with care
policy = "least_load" # the default
admin = { token = "s3cret" }
aliases = { chat = { stable = 100, canary = 0 } }

[[backends]]
url = "http://gpu1:8000"
name = "a"
api_key = "backend-secret"

[[backends]]
url = "http://gpu2:8000"

[[pools]]
name = "stable"
model = "m"
backends = ["a"]

[limits]
auth = true

[[limits.keys]]
name = "ops"
hash = "sha256:aa"
"""

RUNNING = Running(
    policy="least_load",
    weights={"active": 2.0, "queue": 1.0, "kv": 0.5},
    aliases={"chat": {"stable": 60.0, "canary": 40.0}},
    drained_backends=frozenset({"gpu2:8000"}),
    drained_pools=frozenset({"stable"}),
    keys=[
        key_entry(
            "team",
            {
                "hash": "ab" * 32,
                "tier": "default",
                "labels": {"team": "search"},
                "expires_at": 1_900_000_000.0,
                "budget": {"tokens_per_day": 5000, "tokens_per_month": None},
                "limits": {"requests_per_minute": 60},
            },
        )
    ],
    notes=["a rollout of 'chat' is under way"],
)


def test_the_running_state_goes_where_the_file_has_each_setting_its_comments_kept() -> None:
    text = running_toml(FILE, RUNNING, header="Written by llm-gateway state export: now")
    doc = tomllib.loads(text)
    assert doc["aliases"] == {"chat": {"stable": 60, "canary": 40}}
    assert doc["weights"] == {"active": 2, "queue": 1, "kv": 0.5}
    assert [b.get("drain", False) for b in doc["backends"]] == [False, True]
    assert doc["pools"][0]["drain"] is True
    assert doc["limits"]["keys"] == [
        {
            "name": "team",
            "hash": "sha256:" + "ab" * 32,
            "tier": "default",
            "labels": {"team": "search"},
            "expires_at": "2030-03-17T17:46:40Z",
            "tokens_per_day": 5000,
            "limits": {"requests_per_minute": 60},
        }
    ]
    assert "# Our gateway: edit with care" in text
    assert 'policy = "least_load" # the default' in text
    assert "# NOTE: a rollout of 'chat' is under way" in text


def test_no_secret_of_the_file_is_written_and_each_is_named_to_set_again() -> None:
    text = running_toml(FILE, RUNNING, header="Written by llm-gateway state export: now")
    assert "s3cret" not in text
    assert "backend-secret" not in text
    doc = tomllib.loads(text)
    assert doc["admin"]["token"] == REDACTED
    assert doc["backends"][0]["api_key"] == REDACTED
    assert "secrets not written, to set again: admin.token, backends.*.api_key" in text


def test_an_export_of_an_export_has_one_header_and_the_same_settings() -> None:
    once = running_toml(FILE, RUNNING, header="Written by llm-gateway state export: first")
    twice = running_toml(once, RUNNING, header="Written by llm-gateway state export: second")
    assert twice.count("llm-gateway state export") == 1
    assert "second" in twice
    assert tomllib.loads(twice) == tomllib.loads(once)


def test_without_a_file_the_export_holds_what_the_admin_changes_set() -> None:
    doc = tomllib.loads(running_toml(None, RUNNING, header="Written by llm-gateway state export"))
    assert doc["policy"] == "least_load"
    assert doc["limits"]["keys"][0]["name"] == "team"
    assert "backends" not in doc


def test_capacity_rules_set_at_run_time_are_written_and_read_back() -> None:
    rule = rule_doc(Rule(min_awake=0, per_engine=4, ttft_slo=0.5))
    text = running_toml(FILE, replace(RUNNING, capacity_rules={"m": rule}), header="export")
    capacity = Settings.model_validate({"capacity": tomllib.loads(text)["capacity"]}).capacity
    assert capacity.rules() == {"m": Rule(min_awake=0, per_engine=4, ttft_slo=0.5)}
    # none running, none in the file: no [capacity] written
    assert "capacity" not in tomllib.loads(running_toml(FILE, RUNNING, header="export"))
