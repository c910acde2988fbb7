"""Replicas that die, restart, or lose Redis (real processes, a real Redis): a replica started
again applies what it missed before it answers a request; the state survives a restart of
the whole fleet; with Redis gone, changes are refused and requests still served, and once
Redis is back a change goes through again."""

from __future__ import annotations

from pathlib import Path

from tests.gateway.fleet.replicas import ALIAS, poll, running_fleet
from tests.redis_server import RedisServer


async def test_a_replica_started_again_applies_what_it_missed_before_it_answers(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, redis_url, redis_prefix) as fleet:
        r0, r1, r2 = fleet
        await r2.kill()
        status, headers, _ = await fleet.change(r0, "POST", "/admin/backends/a/drain")
        # r2 stays in the registry until its report expires, never counted as having applied.
        applied, alive = headers["X-Gateway-Replicas"].split("/")
        assert (status, applied, alive in ("2", "3")) == (200, "2", True)
        status, _, _ = await fleet.change(
            r1, "PUT", f"/admin/aliases/{ALIAS}", {"stable": 0, "canary": 100}
        )
        assert status == 200
        await r2.start()
        joined = r2.events("fleet_joined")
        assert joined
        assert joined[0]["applied"] == 2
        # In its log, the changes were applied before it listened for requests.
        order = [e["event"] for e in r2.logs]
        assert order.index("fleet_joined") < order.index("gateway_listening")
        assert (await fleet.draining(r2))["a"] is True
        # Its very first requests follow both changes.
        assert (await fleet.send(r2, 4))["a"] == 0
        assert await fleet.send(r2, 4, ALIAS) == {"a": 0, "b": 0, "c": 4}
        status, headers, _ = await fleet.change(r2, "POST", "/admin/backends/a/undrain")
        assert (status, headers["X-Gateway-Replicas"]) == (200, "3/3")


async def test_the_state_survives_a_restart_of_every_replica(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, redis_url, redis_prefix) as fleet:
        r0, r1, _ = fleet
        await fleet.change(r0, "POST", "/admin/backends/b/drain")
        await fleet.change(
            r1, "PUT", "/admin/policy", {"weights": {"active": 5, "queue": 1, "kv": 0}}
        )
        await fleet.change(r0, "PUT", f"/admin/aliases/{ALIAS}", {"stable": 60, "canary": 40})
        await fleet.change(r1, "POST", "/admin/pools/canary/drain")
        before = [await fleet.state(r) for r in fleet]
        assert before[0] == before[1] == before[2]
        for r in fleet:
            await r.stop()
        for r in fleet:
            await r.start()
        after = [await fleet.state(r) for r in fleet]
        assert after == before
        assert after[0][0]["b"] is True
        assert after[0][4]["canary"] is True


async def test_the_log_is_compacted_and_a_new_replica_starts_from_the_snapshot(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, redis_url, redis_prefix, n=2, compact_every=16) as fleet:
        r0, r1 = fleet
        for i in range(40):
            verb = "drain" if i % 2 == 0 else "undrain"
            status, _, _ = await fleet.change(fleet[i % 2], "POST", f"/admin/backends/c/{verb}")
            assert status == 200
        await fleet.change(r0, "PUT", f"/admin/aliases/{ALIAS}", {"stable": 10, "canary": 90})
        await fleet.change(r1, "POST", "/admin/backends/a/drain")

        async def kept() -> int:
            return len((await fleet.read(r0, "/admin/changes?limit=500"))["changes"])

        await poll(kept, lambda n: n <= 16, what="the log compacted")
        await r1.kill()
        await r1.start()  # from the snapshot, then what follows it
        assert r1.events("fleet_snapshot_restored")
        assert await fleet.state(r1) == await fleet.state(r0)
        assert (await fleet.draining(r1))["a"] is True
        assert await fleet.alias(r1) == {"stable": 10.0, "canary": 90.0}


async def test_with_redis_gone_changes_are_refused_and_requests_served(
    tmp_path: Path, own_redis: RedisServer, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, own_redis.url, redis_prefix, n=2) as fleet:
        r0, r1 = fleet
        await fleet.change(r0, "POST", "/admin/backends/a/drain")
        own_redis.stop()
        status, headers, doc = await fleet.change(r1, "POST", "/admin/backends/b/drain")
        assert status == 503
        assert doc["error"]["code"] == "fleet_log_unavailable"
        assert headers["Retry-After"] == "1"
        for r in fleet:  # nothing changed anywhere; traffic flows on the last state
            assert await fleet.draining(r) == {"a": True, "b": False, "c": False}
            assert (await fleet.send(r, 4))["a"] == 0
        own_redis.start()  # empty: it kept nothing
        # The log was lost: changes are refused until the replicas heal it, then go in on the
        # state the fleet had (a drained), not on an empty log's.
        status, _, doc = await fleet.change(r1, "POST", "/admin/backends/c/drain")
        assert (status, doc["error"]["code"]) == (503, "fleet_log_lost")
        await poll(
            lambda: fleet.change(r1, "POST", "/admin/backends/c/drain"),
            lambda answer: answer[0] in (200, 202),
            what="a change taken once the log is healed",
        )
        for r in fleet:
            await poll(lambda r=r: fleet.draining(r), lambda d: d["c"] is True, what="c drained")
            assert await fleet.draining(r) == {"a": True, "b": False, "c": True}


async def test_a_replica_started_while_redis_is_down_serves_and_catches_up_later(
    tmp_path: Path, own_redis: RedisServer, redis_prefix: str
) -> None:
    async with running_fleet(
        tmp_path, own_redis.url, redis_prefix, n=2, start_timeout=1.0
    ) as fleet:
        r0, r1 = fleet
        await r1.stop()
        own_redis.stop()
        await r1.start()  # tries the log for start_timeout, then starts on its file's state
        assert r1.events("fleet_log_unreachable_at_start")
        assert sum((await fleet.send(r1, 4)).values()) == 4  # served, on the file's state
        status, _, doc = await fleet.change(r1, "POST", "/admin/backends/a/drain")
        assert (status, doc["error"]["code"]) == (503, "fleet_log_unavailable")
        own_redis.start()  # empty: taken once the replicas gave the log a new start
        await poll(
            lambda: fleet.change(r0, "POST", "/admin/backends/a/drain"),
            lambda answer: answer[0] in (200, 202),
            what="a change taken once the log is healed",
        )
        await poll(lambda: fleet.draining(r1), lambda d: d["a"] is True, what="r1 caught up")
