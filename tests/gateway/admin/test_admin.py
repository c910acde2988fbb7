"""Live tuning through the admin API: policy, weights and reloads, validated before use."""

from __future__ import annotations

from collections import Counter
from typing import Any

import aiohttp

from gateway.config.settings import Settings
from tests.helpers import FakeBackend, gateway_for, running_fake, running_gateway, wait_for

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def route_counts(s: aiohttp.ClientSession, url: str, n: int) -> Counter[str]:
    counts: Counter[str] = Counter()
    for _ in range(n):
        async with s.post(url + "/v1/completions", json={"model": "m"}) as r:
            assert r.status == 200
            counts[(await r.json())["echo_headers"]["Host"]] += 1
    return counts


async def test_weights_changed_live_change_routing_on_the_next_request() -> None:
    a = FakeBackend(
        metrics_text='vllm:num_requests_waiting{model_name="m"} 4\n'
        'vllm:num_requests_running{model_name="m"} 1\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.1\n'
    )
    b = FakeBackend(
        metrics_text='vllm:num_requests_waiting{model_name="m"} 0\n'
        'vllm:num_requests_running{model_name="m"} 1\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.95\n'
    )
    async with gateway_for(a, b, admin={"token": TOKEN}) as (gw, s):
        assert gw.admin_url is not None
        # Default weights: a's queue of 4 makes b the choice every time.
        assert await route_counts(s, gw.url, 5) == Counter({b.url[7:]: 5})
        change = {"weights": {"active": 0, "queue": 0, "kv": 10}}
        async with s.put(gw.admin_url + "/admin/policy", json=change, headers=AUTH) as r:
            assert r.status == 200
            assert (await r.json())["weights"] == {"active": 0.0, "queue": 0.0, "kv": 10.0}
        # Now KV usage decides: b is nearly full, so a wins.
        assert await route_counts(s, gw.url, 5) == Counter({a.url[7:]: 5})
        async with s.put(
            gw.admin_url + "/admin/policy", json={"policy": "round_robin"}, headers=AUTH
        ) as r:
            assert (await r.json())["policy"] == "round_robin"
        assert await route_counts(s, gw.url, 4) == Counter({a.url[7:]: 2, b.url[7:]: 2})


async def test_invalid_policy_change_is_a_400_and_changes_nothing() -> None:
    fake = FakeBackend()
    async with gateway_for(fake, admin={"token": TOKEN}) as (gw, s):
        assert gw.admin_url is not None
        before = gw.svc.router.policy
        bad: list[Any] = [
            {"policy": "fastest"},
            {"policy": "precise_prefix"},  # this gateway does not follow KV events
            {"weights": {"queue": -1}},
            {"weights": {"queue": "x"}},
            {"colour": "blue"},
            "not an object",
        ]
        for body in bad:
            async with s.put(gw.admin_url + "/admin/policy", json=body, headers=AUTH) as r:
                assert r.status == 400, body
                err = (await r.json())["error"]
                assert err["type"] == "invalid_request_error"
        async with s.put(gw.admin_url + "/admin/policy", data=b"{", headers=AUTH) as r:
            assert r.status == 400
        assert gw.svc.router.policy is before
        async with s.put(gw.admin_url + "/admin/policy", json={"policy": "random"}) as r:
            assert r.status == 401  # and never without the token
        # No such call, or not with that method: an error in the same shape, not plain text.
        async with s.post(gw.admin_url + "/admin/lora/applied", json={}, headers=AUTH) as r:
            assert r.status == 404
            assert (await r.json())["error"]["type"] == "not_found_error"
        async with s.delete(gw.admin_url + "/admin/policy", headers=AUTH) as r:
            assert r.status == 405
            assert "PUT" in r.headers["Allow"]
            assert "DELETE /admin/policy" in (await r.json())["error"]["message"]


async def test_reload_applies_live_settings_and_refuses_a_bad_config() -> None:
    a, b = FakeBackend(), FakeBackend()
    async with running_fake(a), running_fake(b):
        next_settings: list[Any] = []

        def loader() -> Settings:
            item = next_settings.pop(0)
            if isinstance(item, Exception):
                raise item
            return Settings.model_validate(item)

        async with (
            running_gateway([a.url], admin={"token": TOKEN}, loader=loader) as gw,
            aiohttp.ClientSession() as s,
        ):
            assert gw.admin_url is not None
            base = {"backends": [a.url], "admin": {"token": TOKEN}}
            next_settings.append(
                base | {"backends": [a.url, b.url], "policy": "round_robin", "port": 1}
            )
            async with s.post(gw.admin_url + "/admin/reload", headers=AUTH) as r:
                assert r.status == 200
                result = await r.json()
            assert sorted(result["applied"]) == ["backends", "policy"]
            assert "port" in result["restart_required"]
            assert gw.svc.router.policy.name == "round_robin"
            async with s.get(gw.admin_url + "/admin/backends", headers=AUTH) as r:
                ids = {x["id"] for x in (await r.json())["backends"]}
            assert ids == {a.url[7:], b.url[7:]}

            next_settings.append(ValueError("policy: unknown policy 'fastest'"))
            async with s.post(gw.admin_url + "/admin/reload", headers=AUTH) as r:
                assert r.status == 400
                assert "fastest" in (await r.json())["error"]["message"]
            assert gw.svc.router.policy.name == "round_robin"


async def test_reload_that_changes_a_named_backends_url_and_key_takes_effect() -> None:
    """Issue 16.7: the reload said `backends` applied while the old spec stayed in use."""
    old, new = FakeBackend(), FakeBackend()
    async with running_fake(old), running_fake(new):
        pending: list[dict[str, Any]] = []

        def loader() -> Settings:
            return Settings.model_validate(pending.pop(0))

        named = {"name": "gpu", "url": old.url, "api_key": "sk-old"}
        async with (
            running_gateway([named], admin={"token": TOKEN}, loader=loader) as gw,
            aiohttp.ClientSession() as s,
        ):
            assert gw.admin_url is not None
            assert await route_counts(s, gw.url, 2) == Counter({old.url[7:]: 2})
            moved = {"name": "gpu", "url": new.url, "api_key": "sk-new", "role": "both"}
            pending.append({"backends": [moved], "admin": {"token": TOKEN}})
            async with s.post(gw.admin_url + "/admin/reload", headers=AUTH) as r:
                assert r.status == 200
                assert (await r.json())["applied"] == ["backends"]
            await wait_for(gw.ready, what="the new server probed up")
            assert await route_counts(s, gw.url, 3) == Counter({new.url[7:]: 3})
            async with s.get(gw.admin_url + "/admin/backends", headers=AUTH) as r:
                (view,) = (await r.json())["backends"]
    assert view["id"] == "gpu"
    assert view["url"] == new.url
    assert len(old.seen) == 2
    assert [seen.headers["Authorization"] for seen in new.seen] == ["Bearer sk-new"] * 3


async def test_a_revoked_key_is_answered_with_revoked_true_a_json_boolean() -> None:
    """Issue 54: ``DELETE /admin/keys/{name}`` answered ``"revoked": "true"``, a string."""
    async with gateway_for(FakeBackend(), admin={"token": TOKEN}) as (gw, s):
        assert gw.admin_url is not None
        made = {"name": "team-a", "labels": {"team": "search"}}
        async with s.post(gw.admin_url + "/admin/keys", json=made, headers=AUTH) as r:
            assert r.status == 200
            key = await r.json()
        async with s.delete(gw.admin_url + "/admin/keys/team-a", headers=AUTH) as r:
            assert r.status == 200
            revoked = await r.json()
        assert revoked["revoked"] is True
        # The rest of the answer is the key as it was (never its secret, nor its whole hash).
        assert {k: revoked[k] for k in ("name", "tier", "hash", "labels")} == {
            k: key[k] for k in ("name", "tier", "hash", "labels")
        }
        assert revoked["source"] == "runtime"
        assert "key" not in revoked
        async with s.get(gw.admin_url + "/admin/keys", headers=AUTH) as r:
            assert "team-a" not in {k["name"] for k in (await r.json())["keys"]}


async def test_an_undrain_of_a_backend_not_drained_is_answered_as_such_and_changes_nothing() -> (
    None
):
    fake = FakeBackend()
    async with gateway_for(fake, admin={"token": TOKEN}) as (gw, s):
        assert gw.admin_url is not None
        backend = fake.url[7:]
        url = f"{gw.admin_url}/admin/backends/{backend}/undrain"
        async with s.post(url, headers=AUTH) as r:
            assert r.status == 200
            doc = await r.json()
        assert doc["changed"] is False
        assert doc["state"] == {"draining": False}
        async with s.post(f"{gw.admin_url}/admin/backends/{backend}/drain", headers=AUTH) as r:
            assert r.status == 200
            assert "changed" not in await r.json()  # a change: the backend's view, as ever


async def test_a_change_repeated_with_its_idempotency_key_is_answered_as_the_first_once() -> None:
    """One gateway, no fleet: the first answer is kept by its key, a repeat gets it again
    (a key's secret excepted), and the key for another request is refused."""
    fake = FakeBackend()
    async with gateway_for(fake, admin={"token": TOKEN}, limits={"auth": True}) as (gw, s):
        assert gw.admin_url is not None
        headers = {**AUTH, "Idempotency-Key": "make-ci-key"}
        async with s.post(gw.admin_url + "/admin/keys", json={"name": "ci"}, headers=headers) as r:
            assert r.status == 200
            assert r.headers["X-Gateway-Change-Id"] == "make-ci-key"
            first = await r.json()
        assert first["key"].startswith("sk-gw-")
        async with s.post(gw.admin_url + "/admin/keys", json={"name": "ci"}, headers=headers) as r:
            assert (r.status, r.headers["Idempotent-Replayed"]) == (200, "true")
            again = await r.json()
        assert "key" not in again  # made once, answered once
        assert again == {k: v for k, v in first.items() if k not in ("key", "key_note")}
        async with s.post(gw.admin_url + "/admin/keys", json={"name": "x"}, headers=headers) as r:
            assert r.status == 422
            assert (await r.json())["error"]["code"] == "idempotency_key_reused"
        async with s.get(gw.admin_url + "/admin/changes/make-ci-key", headers=AUTH) as r:
            fate = await r.json()
        assert (fate["state"], fate["applied_here"]) == ("applied", True)
        async with s.get(gw.admin_url + "/admin/keys", headers=AUTH) as r:
            assert [k["name"] for k in (await r.json())["keys"]] == ["ci"]
        bad = {**AUTH, "Idempotency-Key": "no spaces/please"}
        async with s.post(gw.admin_url + "/admin/keys", json={"name": "y"}, headers=bad) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "Idempotency-Key"
