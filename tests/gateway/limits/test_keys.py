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
    BudgetExceeded,
    InvalidRequest,
    NotFound,
    RateLimited,
)
from gateway.cli import main as cli_main
from gateway.config.settings import Settings
from gateway.limits.budget import Budget, count_name, resets_at
from gateway.limits.keys import Authenticator, hash_key, presented_key
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
        ({"anonymous_tier": "nope", "auth": False}, "anonymous_tier"),
        # max_priority (default 0) bounds the tier's own priority: 10 would run at 0, silently
        ({"tiers": {"default": {"priority": 10}}}, "set max_priority = 10"),
    ],
)
def test_bad_limits_configuration_is_refused(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        limits_settings(**over)


def test_a_tiers_priority_up_to_its_max_is_its_keys() -> None:
    settings = limits_settings(
        tiers={"urgent": {"priority": 10, "max_priority": 10}},
        keys=[{"name": "alice", "hash": hash_key(ALICE), "tier": "urgent"}],
    )
    alice = Authenticator(settings).authenticate(headers(Authorization=f"Bearer {ALICE}"))
    assert (alice.priority, alice.max_priority) == (10, 10)
    assert LimitsSettings.model_validate({"tiers": {"default": {"priority": -10}}})


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


# 2026-12-31 23:59:00 UTC: a day and a month end a minute later.
NEW_YEARS_EVE = 1798761540.0


async def test_a_budget_is_charged_before_and_corrected_after_and_refuses_when_spent() -> None:
    store = MemoryLimitStore()
    now = [NEW_YEARS_EVE]
    limiter = Limiter(limits_settings(tiers={"default": {}, "gold": {}}), store, lambda: now[0])
    limiter.auth.set_budget("bob", Budget(per_day=1000, per_month=1500))
    bob = limiter.authenticate(headers(x_api_key=BOB))  # no rate limits: the budget alone
    day, month = count_name("day", now[0]), count_name("month", now[0])
    assert (day, month) == ("day:2026-12-31", "month:2026-12")

    async def spent() -> list[int] | None:
        return await store.budget_spent("key:bob", [day, month])

    doc = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 486}
    grant = await limiter.admit(bob, doc)  # 500 reserved from both counts
    assert await spent() == [500, 500]
    await limiter.finish(grant, Usage(10, 90, 100))  # corrected to what it used
    assert await spent() == [100, 100]
    grant = await limiter.admit(bob, doc)
    await limiter.finish(grant, None)  # usage unknown: the reservation stays charged
    assert await spent() == [600, 600]
    with pytest.raises(BudgetExceeded) as refused:  # 600 + 500 > 1000 a day
        await limiter.admit(bob, doc)
    err = refused.value
    assert (err.status, err.envelope()["error"]["code"]) == (429, "budget_exceeded")
    assert err.envelope()["error"]["type"] == "insufficient_quota"
    assert "2027-01-01T00:00:00Z" in err.message  # when it resets
    assert err.headers["Retry-After"] == "60"
    assert limiter.rejections[("key:bob", "budget")] == 1
    assert await spent() == [600, 600]  # the refused request took nothing
    # A new day and month: both counts start again from zero.
    now[0] += 120
    await limiter.finish(await limiter.admit(bob, doc), Usage(10, 390, 400))
    assert await store.budget_spent("key:bob", ["day:2027-01-01", "month:2027-01"]) == [400, 400]
    usage = await limiter.usage("bob", days=3)
    assert usage["days"] == [
        {"day": "2027-01-01", "tokens": 400, "models": {"m": 400}},
        {"day": "2026-12-31", "tokens": 600, "models": {"m": 600}},
    ]
    periods = usage["budget"]["periods"]
    assert periods["day"] == {"limit": 1000, "spent": 400, "resets_at": "2027-01-02T00:00:00Z"}
    assert periods["month"]["resets_at"] == "2027-02-01T00:00:00Z"
    # The month's count refuses on its own: 1,500 a month, 400 spent, 1,200 more asked.
    limiter.auth.set_budget("bob", Budget(per_day=5000, per_month=1500))
    bob = limiter.authenticate(headers(x_api_key=BOB))
    with pytest.raises(BudgetExceeded, match="month"):
        await limiter.admit(bob, {**doc, "max_tokens": 1186})
    limiter.auth.set_budget("bob", None)
    bob = limiter.authenticate(headers(x_api_key=BOB))
    assert bob.budget is None
    await limiter.finish(await limiter.admit(bob, doc), Usage(1, 1, 2))  # no budget: admitted


async def test_a_tiers_budget_is_each_of_its_keys_own_and_a_keys_budget_comes_first() -> None:
    settings = limits_settings(tiers={"default": {"tokens_per_day": 600}, "gold": {}})
    limiter = Limiter(settings, MemoryLimitStore(), lambda: NEW_YEARS_EVE)
    limiter.auth.add("carol", hash_key("sk-carol"), "default")
    doc = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 486}
    for key in (BOB, "sk-carol"):  # 500 each from separate counts
        who = limiter.authenticate(headers(x_api_key=key))
        assert who.budget == Budget(per_day=600, source="tier")
        await limiter.finish(await limiter.admit(who, doc), None)
    with pytest.raises(BudgetExceeded):
        await limiter.admit(limiter.authenticate(headers(x_api_key=BOB)), doc)
    limiter.auth.set_budget("bob", Budget(per_day=5000))  # its own, above the tier's
    bob = limiter.authenticate(headers(x_api_key=BOB))
    await limiter.finish(await limiter.admit(bob, doc), None)  # the day's 500 still counted
    view = await limiter.budget_view("bob", limiter.auth.budget("bob"))
    assert view is not None
    assert (view["source"], view["periods"]["day"]["spent"]) == ("key", 1000)
    assert resets_at("month", NEW_YEARS_EVE) == resets_at("day", NEW_YEARS_EVE)


def test_a_rotated_key_works_with_its_old_secret_until_the_overlap_ends() -> None:
    now = [1000.0]
    auth = Authenticator(limits_settings(), lambda: now[0])
    auth.add("carol", hash_key("sk-old"), "gold", labels={"team": "search"})
    doc = auth.rotate("carol", hash_key("sk-new"), overlap_until=1060.0)
    assert doc["previous_until"] == "1970-01-01T00:17:40Z"
    assert doc["labels"] == {"team": "search"}
    for key in ("sk-old", "sk-new"):
        assert auth.authenticate(headers(x_api_key=key)).id == "key:carol"
    # Another replica, from a snapshot, honours the same window.
    other = Authenticator(limits_settings(), lambda: now[0])
    other.restore(auth.state())
    assert other.authenticate(headers(x_api_key="sk-old")).id == "key:carol"
    now[0] = 1060.0
    for a in (auth, other):
        with pytest.raises(AuthenticationError, match="Incorrect"):
            a.authenticate(headers(x_api_key="sk-old"))
        assert a.authenticate(headers(x_api_key="sk-new")).id == "key:carol"
    # A configured key rotated: the change is run-time state, and survives a snapshot too.
    auth.rotate("bob", hash_key("sk-bob-new"), overlap_until=0.0)
    other.restore(auth.state())
    assert other.authenticate(headers(x_api_key="sk-bob-new")).id == "key:bob"
    with pytest.raises(AuthenticationError):
        other.authenticate(headers(x_api_key=BOB))


def test_an_expired_key_is_refused_with_its_own_message() -> None:
    now = [1000.0]
    settings = limits_settings(
        keys=[{"name": "eve", "hash": hash_key("sk-eve"), "expires_at": "1970-01-01T00:20:00Z"}]
    )
    auth = Authenticator(settings, lambda: now[0])
    auth.add("dan", hash_key("sk-dan"), "default", expires_at=1100.0)
    assert auth.authenticate(headers(x_api_key="sk-dan")).id == "key:dan"
    now[0] = 1100.0
    with pytest.raises(AuthenticationError) as expired:
        auth.authenticate(headers(x_api_key="sk-dan"))
    assert expired.value.code == "expired_api_key"
    assert "expired at 1970-01-01T00:18:20Z" in expired.value.message
    assert auth.authenticate(headers(x_api_key="sk-eve")).id == "key:eve"  # until 1,200
    now[0] = 1200.0
    with pytest.raises(AuthenticationError, match="expired"):
        auth.authenticate(headers(x_api_key="sk-eve"))


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


def test_with_auth_on_the_anonymous_tier_need_not_exist_nor_a_key_in_the_file() -> None:
    """Keys may all be made at run time; anonymous callers are refused anyway."""
    settings = LimitsSettings.model_validate(
        {"auth": True, "tiers": {"gold": {"requests_per_minute": 5}}}
    )
    auth = Authenticator(settings)
    with pytest.raises(AuthenticationError):
        auth.authenticate(headers())
    auth.add("team", hash_key("sk-team"), "gold")
    assert auth.authenticate(headers(x_api_key="sk-team")).tier == "gold"
    with pytest.raises(ValidationError, match="anonymous_tier"):
        LimitsSettings.model_validate({"auth": False, "tiers": {"gold": {}}})


def test_a_keys_own_limits_replace_its_tiers_and_survive_a_snapshot() -> None:
    auth = Authenticator(limits_settings())  # gold: 1,000 tokens a minute, 1 at once
    auth.add("carol", hash_key("sk-carol"), "gold", limits={"max_concurrent": 4})
    carol = auth.authenticate(headers(x_api_key="sk-carol"))
    assert (carol.limits.max_concurrent, carol.limits.tokens_per_minute) == (4, 1000)
    assert auth.describe("carol")["limits"] == {"max_concurrent": 4}
    other = Authenticator(limits_settings())
    other.restore(auth.state())
    assert other.authenticate(headers(x_api_key="sk-carol")).limits == carol.limits
