"""API keys, the limits settings, the limiter façade and `llm-gateway keys hash`."""

from __future__ import annotations

import io
import tomllib
from pathlib import Path
from typing import Any

import pytest
from multidict import CIMultiDict
from pydantic import ValidationError

from backends.errors import (
    AuthenticationError,
    BudgetExhausted,
    InvalidRequest,
    NotFound,
    RateLimited,
)
from gateway.cli import main as cli_main
from gateway.config.settings import Settings
from gateway.limits.keys import Authenticator, Budget, hash_key, presented_key
from gateway.limits.limiter import Limiter
from gateway.limits.memory import MemoryLimitStore
from gateway.limits.settings import LimitsSettings
from gateway.limits.tokens import Usage

ALICE = "sk-alice-secret"
BOB = "sk-bob-secret"


def limits_settings(**over: Any) -> LimitsSettings:
    raw: dict[str, Any] = {
        "auth": True,
        "tiers": {
            "default": {"requests_per_minute": 2},
            "gold": {"tokens_per_minute": 1000, "max_concurrent": 1, "max_priority": 5},
        },
        "keys": [
            {"name": "alice", "hash": hash_key(ALICE), "tier": "gold"},
            {"name": "bob", "hash": hash_key(BOB)[len("sha256:") :]},
        ],
    }
    raw.update(over)
    return LimitsSettings.model_validate(raw)


def headers(**h: str) -> CIMultiDict[str]:
    return CIMultiDict({k.replace("_", "-"): v for k, v in h.items()})


def test_key_read_from_bearer_or_x_api_key() -> None:
    assert presented_key(headers(Authorization=f"Bearer {ALICE}")) == ALICE
    assert presented_key(headers(authorization=f"bearer  {ALICE} ")) == ALICE
    assert presented_key(headers(x_api_key=ALICE)) == ALICE
    assert presented_key(headers(Authorization="Basic abc")) is None
    assert presented_key(headers()) is None


def test_known_keys_get_their_tier() -> None:
    auth = Authenticator(limits_settings())
    alice = auth.authenticate(headers(Authorization=f"Bearer {ALICE}"))
    assert (alice.id, alice.tier, alice.authenticated) == ("key:alice", "gold", True)
    assert alice.limits.tokens_per_minute == 1000
    assert alice.max_priority == 5
    bob = auth.authenticate(headers(x_api_key=BOB))
    assert (bob.id, bob.tier, bob.limits.requests_per_minute) == ("key:bob", "default", 2)


def test_keys_added_rotated_and_revoked_at_run_time() -> None:
    auth = Authenticator(limits_settings())
    carol = "sk-carol-secret"
    assert auth.add("carol", hash_key(carol), "gold")["source"] == "runtime"
    assert auth.authenticate(headers(x_api_key=carol)).id == "key:carol"
    rotated = "sk-carol-rotated"
    auth.add("carol", hash_key(rotated), "default")  # the same name: a rotation
    assert auth.authenticate(headers(x_api_key=rotated)).tier == "default"
    with pytest.raises(AuthenticationError):
        auth.authenticate(headers(x_api_key=carol))
    auth.revoke("bob")  # a configured key may be revoked too
    with pytest.raises(AuthenticationError):
        auth.authenticate(headers(x_api_key=BOB))
    listed = {k["name"]: k for k in auth.listing()}
    assert sorted(listed) == ["alice", "carol"]
    assert len(listed["carol"]["hash"]) == 12  # a prefix, never the whole hash
    # The run-time part survives into another replica's authenticator (a snapshot).
    other = Authenticator(limits_settings())
    other.restore(auth.state())
    assert other.listing() == auth.listing()
    assert other.authenticate(headers(x_api_key=rotated)).id == "key:carol"


@pytest.mark.parametrize(
    ("name", "key_hash", "tier", "why"),
    [
        ("dave", "not-a-hash", "default", "sha256"),
        ("dave", hash_key("x"), "platinum", "No tier"),
        ("bad name!", hash_key("x"), "default", "name"),
        ("dave", hash_key(ALICE), "default", "Another key"),
    ],
)
def test_a_key_that_cannot_be_added_is_refused_and_changes_nothing(
    name: str, key_hash: str, tier: str, why: str
) -> None:
    auth = Authenticator(limits_settings())
    before = auth.listing()
    with pytest.raises(InvalidRequest, match=why):
        auth.add(name, key_hash, tier)
    assert auth.listing() == before
    with pytest.raises(NotFound):
        auth.revoke("nobody")


def test_missing_or_unknown_key_is_401_when_auth_is_on() -> None:
    auth = Authenticator(limits_settings())
    with pytest.raises(AuthenticationError) as missing:
        auth.authenticate(headers())
    assert missing.value.status == 401
    assert missing.value.envelope()["error"]["type"] == "authentication_error"
    assert missing.value.code == "missing_api_key"
    with pytest.raises(AuthenticationError) as wrong:
        auth.authenticate(headers(Authorization="Bearer sk-nope"))
    assert wrong.value.code == "invalid_api_key"
    assert "sk-nope" not in wrong.value.message


def test_auth_off_makes_unknown_callers_anonymous_but_honours_known_keys() -> None:
    auth = Authenticator(limits_settings(auth=False))
    anon = auth.authenticate(headers(Authorization="Bearer sk-nope"))
    assert (anon.id, anon.authenticated) == ("anonymous", False)
    assert auth.authenticate(headers(x_api_key=ALICE)).id == "key:alice"


def test_defaults_are_auth_off_and_unlimited() -> None:
    s = LimitsSettings()
    anon = Authenticator(s).authenticate(headers())
    assert anon.limits.unlimited
    assert s.store == "memory"
    assert s.redis.timeout == 0.05


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"keys": [{"name": "x", "hash": "abc"}]}, "64 hex digits"),
        ({"keys": [{"name": "x", "hash": hash_key("k"), "tier": "nope"}]}, "unknown tier"),
        (
            {"keys": [{"name": "x", "hash": hash_key("k")}, {"name": "x", "hash": hash_key("j")}]},
            "listed twice",
        ),
        ({"anonymous_tier": "nope"}, "anonymous_tier"),
        ({"keys": []}, "no keys"),
    ],
)
def test_bad_limits_configuration_is_refused(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        limits_settings(**over)


def test_limits_settings_mount_under_gateway_settings_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class WithLimits(Settings):
        limits: LimitsSettings = LimitsSettings()

    monkeypatch.setenv("GATEWAY_LIMITS__STORE", "redis")
    monkeypatch.setenv("GATEWAY_LIMITS__REDIS__FAILURE_MODE", "closed")
    s = WithLimits()
    assert s.limits.store == "redis"
    assert s.limits.redis.failure_mode == "closed"


async def test_limiter_reserves_estimate_and_refunds_on_finish() -> None:
    limiter = Limiter(limits_settings(), MemoryLimitStore())
    alice = limiter.authenticate(headers(Authorization=f"Bearer {ALICE}"))
    doc = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 486}
    grant = await limiter.admit(alice, doc)
    assert grant.reserved == 500  # 10 + 4 overhead + 486
    assert grant.headers["x-ratelimit-remaining-tokens"] == "500"
    with pytest.raises(RateLimited) as busy:  # max_concurrent = 1
        await limiter.admit(alice, doc)
    assert busy.value.envelope()["error"]["code"] == "rate_limit_exceeded"
    assert limiter.rejections[("key:alice", "concurrency")] == 1
    await limiter.finish(grant, Usage(10, 20, 30))
    await limiter.finish(grant, Usage(10, 20, 30))
    again = await limiter.admit(alice, doc)  # 1000 - 30 left: 500 fits
    assert again.headers["x-ratelimit-remaining-tokens"] == "470"


async def test_a_budget_is_charged_before_and_corrected_after_and_refuses_when_spent() -> None:
    store = MemoryLimitStore()
    limiter = Limiter(limits_settings(tiers={"default": {}, "gold": {}}), store)
    limiter.auth.set_budget("bob", Budget(1000, "bob:1"))
    bob = limiter.authenticate(headers(x_api_key=BOB))  # no rate limits: the budget alone
    doc = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 486}
    grant = await limiter.admit(bob, doc)  # 500 reserved
    assert await store.budget_spent("bob:1") == 500
    await limiter.finish(grant, Usage(10, 90, 100))  # corrected to what it used
    assert await store.budget_spent("bob:1") == 100
    grant = await limiter.admit(bob, doc)
    await limiter.finish(grant, None)  # usage unknown: the reservation stays charged
    assert await store.budget_spent("bob:1") == 600
    with pytest.raises(BudgetExhausted) as spent:  # 600 + 500 > 1000
        await limiter.admit(bob, doc)
    assert spent.value.envelope()["error"]["type"] == "insufficient_quota"
    assert spent.value.status == 429
    assert limiter.rejections[("key:bob", "budget")] == 1
    assert await store.budget_spent("bob:1") == 600  # the refused request took nothing
    limiter.auth.set_budget("bob", None)
    bob = limiter.authenticate(headers(x_api_key=BOB))
    await limiter.finish(await limiter.admit(bob, doc), Usage(1, 1, 2))  # no budget: admitted


def keys_cli(argv: list[str]) -> int:
    """``llm-gateway keys ...`` as the CLI registers it (without the other subcommands)."""
    return cli_main(argv)


def test_cli_keys_hash_prints_the_configured_form(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(ALICE + "\n"))
    assert keys_cli(["keys", "hash"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == hash_key(ALICE)
    assert LimitsSettings.model_validate({"keys": [{"name": "a", "hash": printed}]}).keys[
        0
    ].hash == printed.removeprefix("sha256:")


def test_cli_keys_hash_refuses_empty_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert keys_cli(["keys", "hash"]) == 2


def test_the_documented_example_configuration_is_valid() -> None:
    text = (Path(__file__).parents[3] / "docs" / "limits.md").read_text()
    example = text.split("```toml\n", 1)[1].split("```", 1)[0]
    s = LimitsSettings.model_validate(tomllib.loads(example)["limits"])
    assert s.store == "redis"
    assert s.keys[0].tier == "gold"
    assert s.admission.max_in_flight == 64
