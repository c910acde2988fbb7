"""Admin answers that never lie, with Redis in trouble beneath three real replicas (real
processes, a real Redis of the test's own): paused during a change, killed in the middle of one,
its answer delayed after the write landed, restarted empty. In every case each change is
followed by its id on every replica (``GET /admin/changes/{id}``), the answer its caller got
matches what every replica ends up applying, a call repeated with the same ``Idempotency-Key``
is applied once, the views answer 200 (marked stale while Redis is away), and no replica logs
a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.limits.keys import hash_key
from tests.gateway.fleet.replicas import ALIAS, Fleet, Replica, poll, running_fleet
from tests.redis_proxy import holding_proxy
from tests.redis_server import RedisServer

VIEWS = ("/admin/replicas", "/admin/changes", "/admin/rollouts", "/admin/keys")
SETTLED = ("applied", "not_applied")
# Short waits for Redis: a fault shows in a second, not in the defaults' two
FAST = {"log_timeout": 1.0, "view_timeout": 0.5}


async def fates(fleet: Fleet, cid: str) -> list[dict[str, Any]]:
    return [await fleet.read(r, f"/admin/changes/{cid}") for r in fleet]


async def settled(fleet: Fleet, cid: str) -> str:
    """The fate of ``cid`` once every replica tells it, the same everywhere."""
    got = await poll(
        lambda: fates(fleet, cid),
        lambda docs: all(d["state"] in SETTLED for d in docs),
        within=30,
        what=f"the fate of {cid} known on every replica",
    )
    states = {d["state"] for d in got}
    assert len(states) == 1, got
    return states.pop()


async def entries_with(fleet: Fleet, cid: str) -> int:
    changes = (await fleet.read(fleet[0], "/admin/changes?limit=500"))["changes"]
    return sum(1 for c in changes if c["id"] == cid)


def tracebacks(replica: Replica) -> list[dict[str, Any]]:
    return [e for e in replica.logs if "exception" in e or "Traceback" in str(e)]


async def stale_views(fleet: Fleet) -> None:
    """Every view of every replica answers 200, marked stale, while Redis does not answer."""
    for r in fleet:
        for path in (*VIEWS, "/admin/keys/ops/usage"):
            doc = await fleet.read(r, path)  # asserts the 200
            assert "stale" in doc, (r.name, path, doc)
        replicas = await fleet.read(r, "/admin/replicas")
        assert r.name in [x["id"] for x in replicas["replicas"]]  # itself, as it is now


async def keys_everywhere(fleet: Fleet) -> list[set[str]]:
    return [{k["name"] for k in (await fleet.read(r, "/admin/keys"))["keys"]} for r in fleet]


async def test_a_key_made_while_redis_is_paused_exists_everywhere_or_nowhere_as_answered(
    tmp_path: Path, own_redis: RedisServer, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, own_redis.url, redis_prefix, auth=True, **FAST) as fleet:
        r0, r1, r2 = fleet
        budget = {"tokens_per_day": 10_000}  # its spent count is read from Redis
        assert (await fleet.change(r0, "PUT", "/admin/keys/ops/budget", budget))[0] == 200
        for r in fleet:  # each view read once while Redis answers: the last state known
            for path in (*VIEWS, "/admin/keys/ops/usage"):
                assert "stale" not in await fleet.read(r, path)
        own_redis.pause()
        try:
            status, headers, first = await fleet.change(
                r0, "POST", "/admin/keys", {"name": "late"}, key="make-late"
            )
            # Certainly not written (503: no connection to Redis could be made), or written
            # perhaps (202: sent, no answer): never "nothing changed" when it may have.
            assert status in (202, 503), first
            assert headers["X-Gateway-Change-Id"] == "make-late"
            if status == 202:
                assert first["state"] == "unknown"
                secret = first["key"]  # the key exists if the change is applied: said now
            else:
                assert first["error"]["code"] == "fleet_log_unavailable"
                secret = None
            await stale_views(fleet)
            assert [d["state"] for d in await fates(fleet, "make-late")] == ["unknown"] * 3
            again, _, _ = await fleet.change(
                r1, "POST", "/admin/keys", {"name": "late"}, key="make-late"
            )
            assert again in (202, 503)
        finally:
            own_redis.resume()
        fate = await settled(fleet, "make-late")
        has_it = [("late" in names) for names in await keys_everywhere(fleet)]
        assert has_it == [fate == "applied"] * 3
        if secret is not None:
            for r in fleet:
                assert await fleet.status_with(r, secret) == (200 if fate == "applied" else 401)
        # The call repeated once Redis answers: the first one's change if it was made, else
        # made now; once either way.
        status, headers, doc = await fleet.change(
            r2, "POST", "/admin/keys", {"name": "late"}, key="make-late"
        )
        assert status == 200, doc
        assert headers.get("Idempotent-Replayed") == ("true" if fate == "applied" else None)
        assert ("key" in doc) is (fate != "applied")  # a secret is answered once, when made
        assert await settled(fleet, "make-late") == "applied"
        assert await keys_everywhere(fleet) == [{"ops", "late"}] * 3
        assert await entries_with(fleet, "make-late") == 1
        # The same key for another request is refused, and changes nothing.
        status, _, doc = await fleet.change(
            r0, "POST", "/admin/keys", {"name": "other"}, key="make-late"
        )
        assert (status, doc["error"]["code"]) == (422, "idempotency_key_reused")
        assert await keys_everywhere(fleet) == [{"ops", "late"}] * 3
    for r in fleet:
        assert tracebacks(r) == []
        assert len(r.events("admin_views_stale")) == 1  # one line for the outage


async def test_a_change_caught_in_a_redis_killed_mid_change_is_applied_nowhere_and_retried_once(
    tmp_path: Path, own_redis: RedisServer, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, own_redis.url, redis_prefix, **FAST) as fleet:
        r0, r1, r2 = fleet
        status, _, _ = await fleet.change(r1, "POST", "/admin/backends/a/drain")
        assert status == 200
        before = [await fleet.state(r) for r in fleet]
        own_redis.pause()  # the change waits in Redis's socket...
        weights = {"stable": 37, "canary": 63}
        status, _, doc = await fleet.change(
            r0, "PUT", f"/admin/aliases/{ALIAS}", weights, key="shift-37"
        )
        assert status in (202, 503), doc
        own_redis.stop()  # ...and dies with it
        own_redis.start()  # empty
        assert await settled(fleet, "shift-37") == "not_applied"
        assert [await fleet.state(r) for r in fleet] == before  # a drained, everywhere
        status, headers, doc = await poll(
            lambda: fleet.change(r2, "PUT", f"/admin/aliases/{ALIAS}", weights, key="shift-37"),
            lambda answer: answer[0] != 503,
            what="the change taken once the log is healed",
        )
        assert status == 200, doc
        assert "Idempotent-Replayed" not in headers
        assert await settled(fleet, "shift-37") == "applied"
        assert [await fleet.alias(r) for r in fleet] == [{"stable": 37.0, "canary": 63.0}] * 3
        assert [(await fleet.draining(r))["a"] for r in fleet] == [True] * 3
        assert await entries_with(fleet, "shift-37") == 1
    for r in fleet:
        assert tracebacks(r) == []


async def test_a_change_whose_answer_redis_delays_is_answered_202_and_applied_once(
    tmp_path: Path, own_redis: RedisServer, redis_prefix: str
) -> None:
    """Redis takes the write but its answer is held (a proxy in front of it): the replica that
    asked cannot know, answers 202 with the id, and the id tells "applied" as soon as known."""
    async with (
        holding_proxy(own_redis.port) as proxy,
        running_fleet(tmp_path, proxy.url, redis_prefix, **FAST) as fleet,
    ):
        r0, r1, _ = fleet
        proxy.hold(after=b"XADD")  # the writers' answers wait; every reader goes on
        try:
            body = {"weights": {"active": 3, "queue": 1, "kv": 0}}
            status, headers, doc = await fleet.change(r0, "PUT", "/admin/policy", body, key="w3")
            assert (status, doc["state"], headers["X-Gateway-Change"]) == (
                202,
                "unknown",
                "unknown",
            )
            # The write landed: every replica applies it, and its id says so everywhere.
            assert await settled(fleet, "w3") == "applied"
            for r in fleet:
                assert (await fleet.read(r, "/admin/policy"))["weights"]["active"] == 3
            # Repeated while the first answer is still held: the first call's change.
            status, headers, _ = await fleet.change(r1, "PUT", "/admin/policy", body, key="w3")
            assert (status, headers["Idempotent-Replayed"]) == (200, "true")
        finally:
            proxy.release()
        assert await entries_with(fleet, "w3") == 1
    for r in fleet:
        assert tracebacks(r) == []


async def test_redis_restarted_empty_is_flagged_and_healed_to_the_fleets_state(
    tmp_path: Path, own_redis: RedisServer, redis_prefix: str
) -> None:
    """Beneath three running replicas Redis comes back empty: each flags the loss; the one
    furthest ahead writes its state back, the others take it, and a replica started afterwards
    starts from it too, not from its file; the budget spent is still counted."""
    async with running_fleet(tmp_path, own_redis.url, redis_prefix, auth=True, **FAST) as fleet:
        r0, r1, r2 = fleet
        team = "sk-team-secret"
        assert (await fleet.change(r0, "POST", "/admin/backends/b/drain"))[0] == 200
        weights = {"stable": 70, "canary": 30}
        assert (await fleet.change(r1, "PUT", f"/admin/aliases/{ALIAS}", weights))[0] == 200
        made = {"name": "team", "hash": hash_key(team), "tokens_per_day": 100_000}
        assert (await fleet.change(r2, "POST", "/admin/keys", made))[0] == 200
        for r in fleet:
            assert await fleet.status_with(r, team) == 200
        usage = await fleet.read(r0, "/admin/keys/team/usage")
        spent = usage["budget"]["periods"]["day"]["spent"]
        assert spent > 0
        before = [await fleet.state(r) for r in fleet]
        assert before[0] == before[1] == before[2]

        own_redis.stop()
        own_redis.start()  # no persistence: the log, its epoch, the registry, the counts gone

        await poll(
            lambda: fleet.change(r0, "POST", "/admin/backends/c/drain"),
            lambda answer: answer[0] == 200,
            within=30,
            what="a change taken once the log is healed",
        )
        for r in fleet:
            assert r.events("fleet_log_lost"), r.name  # each flagged it
            doc = await fleet.read(r, "/admin/replicas")
            assert doc["losses"] == 1
            assert doc["summary"]["log_problems"] == {}
        assert sum(len(r.events("fleet_log_healed")) for r in fleet) == 1  # one wrote it back
        after = [await fleet.state(r) for r in fleet]
        for state in after:  # what it was, plus the change made since
            assert state[0] == {**before[0][0], "c": True}
            assert state[1:] == before[0][1:]
        for r in fleet:
            assert await fleet.status_with(r, team) == 200  # the run-time key, everywhere
            usage = await fleet.read(r, "/admin/keys/team/usage")
            assert usage["budget"]["periods"]["day"]["spent"] >= spent  # still counted

        await r2.stop()
        await r2.start()  # one replica, not all: it starts from the healed log
        assert await fleet.state(r2) == await fleet.state(r0)
        assert await fleet.status_with(r2, team) == 200
        metrics = await fleet.session.get(r0.url + "/metrics")
        text = await metrics.text()
        assert "llm_gateway_fleet_log_losses_total 1.0" in text
    for r in fleet:
        assert tracebacks(r) == []
