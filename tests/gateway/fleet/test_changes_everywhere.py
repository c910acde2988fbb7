"""Three replicas (real processes) and a real Redis: an admin change made through one replica
is applied by all three, within the answer's wait, and requests through the others follow it;
two conflicting changes made at once end in one state everywhere; a bad change is refused
where it is made and logged nowhere."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from gateway.limits.keys import hash_key
from tests.gateway.fleet.replicas import ALIAS, AUTH, OPS_KEY, poll, running_fleet


async def test_a_change_through_one_replica_is_applied_by_all_and_requests_follow_it(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, redis_url, redis_prefix) as fleet:
        r0, r1, r2 = fleet
        # A drain: answered once every replica applied it, within the wait (fleet.wait, 1 s).
        status, headers, doc = await fleet.change(r0, "POST", "/admin/backends/a/drain")
        assert (status, doc["draining"]) == (200, True)
        assert headers["X-Gateway-Replicas"] == "3/3"
        for r in fleet:
            assert (await fleet.draining(r))["a"] is True
        for r in (r1, r2):
            assert (await fleet.send(r, 8))["a"] == 0  # the drained backend gets nothing
        # The policy's weights.
        weights = {"active": 3.0, "queue": 0.5, "kv": 2.0}
        status, headers, doc = await fleet.change(r0, "PUT", "/admin/policy", {"weights": weights})
        assert (status, headers["X-Gateway-Replicas"]) == (200, "3/3")
        for r in fleet:
            assert (await fleet.read(r, "/admin/policy"))["weights"] == weights
        # An alias shifted to the canary, then rolled back.
        status, headers, doc = await fleet.change(
            r0, "PUT", f"/admin/aliases/{ALIAS}", {"stable": 0, "canary": 100}
        )
        assert (status, headers["X-Gateway-Replicas"]) == (200, "3/3")
        for r in (r1, r2):
            assert await fleet.send(r, 6, ALIAS) == {"a": 0, "b": 0, "c": 6}
        status, headers, doc = await fleet.change(r0, "POST", f"/admin/aliases/{ALIAS}/rollback")
        assert (status, headers["X-Gateway-Replicas"]) == (200, "3/3")
        for r in fleet:
            assert await fleet.alias(r) == {"stable": 100.0, "canary": 0.0}
        for r in (r1, r2):
            got = await fleet.send(r, 6, ALIAS)
            assert got["c"] == 0
            assert got["b"] == 6
        # The audit trail, on any replica: each change, who made it where, old and new.
        trail = (await fleet.read(r2, "/admin/changes"))["changes"]
        assert [(c["method"], c["path"]) for c in reversed(trail)] == [
            ("POST", "/admin/backends/a/drain"),
            ("PUT", "/admin/policy"),
            ("PUT", f"/admin/aliases/{ALIAS}"),
            ("POST", f"/admin/aliases/{ALIAS}/rollback"),
        ]
        assert {c["replica"] for c in trail} == {"r0"}
        assert trail[-1]["old"] == {"draining": False}
        assert trail[-1]["new"] == {"draining": True}
        assert trail[1]["old"] == {"stable": 100.0, "canary": 0.0}
        assert trail[1]["new"] == {"stable": 0.0, "canary": 100.0}
        replicas = await fleet.read(r1, "/admin/replicas")
        assert sorted(r["id"] for r in replicas["replicas"]) == ["r0", "r1", "r2"]
        assert replicas["summary"]["lagging"] == []


async def test_a_bad_change_is_refused_where_it_is_made_and_logged_nowhere(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, redis_url, redis_prefix, n=2) as fleet:
        r0, r1 = fleet
        for method, path, body, status in (
            ("POST", "/admin/backends/nope/drain", None, 404),
            ("PUT", "/admin/policy", {"policy": "nope"}, 400),
            ("PUT", f"/admin/aliases/{ALIAS}", {"nowhere": 100}, 400),
            ("POST", f"/admin/aliases/{ALIAS}/rollback", None, 400),  # no history yet
            ("POST", "/admin/pools/stable/drain", None, 400),  # would leave the alias no pool
            ("POST", "/admin/keys", {"tier": "default"}, 400),  # no name
            ("POST", "/admin/keys", {"name": "x", "tier": "platinum"}, 400),
            ("POST", "/admin/keys", {"name": "x", "hash": "sha256:nothex"}, 400),
            ("DELETE", "/admin/keys/nobody", None, 404),
            ("POST", "/admin/keys", {"name": "x", "expires_at": "2000-01-01T00:00:00Z"}, 400),
            ("POST", "/admin/keys", {"name": "x", "labels": {"bad name": "v"}}, 400),
            ("POST", "/admin/keys", {"name": "x", "tokens_per_day": 0}, 400),
            ("POST", "/admin/keys/nobody/rotate", None, 404),
            ("POST", "/admin/keys/x/rotate", {"overlap_seconds": -1}, 400),
            ("PUT", "/admin/keys/x/budget", {"tokens": 5}, 400),
            ("PUT", "/admin/keys/nobody/budget", {"tokens_per_day": 5}, 404),
        ):
            got, _, doc = await fleet.change(r0, method, path, body)
            assert got == status, doc
            assert doc["error"]["message"]
        assert (await fleet.read(r1, "/admin/changes"))["changes"] == []
        assert await fleet.state(r0) == await fleet.state(r1)


async def test_two_conflicting_changes_at_once_end_in_one_state_everywhere(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, redis_url, redis_prefix) as fleet:
        r0, r1, r2 = fleet
        for _ in range(5):
            answers = await asyncio.gather(
                fleet.change(r0, "POST", "/admin/backends/b/drain"),
                fleet.change(r1, "POST", "/admin/backends/b/undrain"),
                fleet.change(r1, "PUT", f"/admin/aliases/{ALIAS}", {"stable": 30, "canary": 70}),
                fleet.change(r2, "PUT", f"/admin/aliases/{ALIAS}", {"stable": 80, "canary": 20}),
            )
            # Each applied everywhere, or (a drain of a drained backend: the other came first)
            # answered as already so, and not logged.
            assert [
                (s, h.get("X-Gateway-Replicas", "unchanged" if doc.get("changed") is False else ""))
                for s, h, doc in answers
            ] in ([(200, "3/3")] * 4, [(200, "3/3"), (200, "unchanged"), *[(200, "3/3")] * 2],
                  [(200, "unchanged"), *[(200, "3/3")] * 3])  # fmt: skip
            states = [await fleet.state(r) for r in fleet]
            assert states[0] == states[1] == states[2]
        # The last in the log's order is what every replica has.
        last = {}
        for c in reversed((await fleet.read(r0, "/admin/changes?limit=100"))["changes"]):
            last[c["path"].split("/")[2]] = c
        assert states[0][0]["b"] is (last["backends"]["path"].endswith("/drain"))
        assert await fleet.alias(r2) == last["aliases"]["new"]


async def test_the_workers_of_a_host_are_replicas_of_the_fleet(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, redis_url, redis_prefix, n=2, workers=(2,)) as fleet:
        host, single = fleet
        # Each reports itself on its own timer: all three are listed once each has.
        await poll(
            lambda: fleet.read(single, "/admin/replicas"),
            lambda doc: sorted(r["id"] for r in doc["replicas"]) == ["r0/w0", "r0/w1", "r1"],
            what="three replicas listed",
        )
        status, headers, _ = await fleet.change(single, "POST", "/admin/backends/b/drain")
        assert (status, headers["X-Gateway-Replicas"]) == (200, "3/3")
        # Requests on separate connections reach both workers: none goes to b.
        got = await fleet.send(host, 12, fresh_connections=True)
        assert got["b"] == 0
        assert {e["worker"] for e in host.events("request")} == {0, 1}
        status, headers, _ = await fleet.change(host, "POST", "/admin/backends/b/undrain")
        assert (status, headers["X-Gateway-Replicas"]) == (200, "3/3")


async def test_sighup_to_one_replica_reloads_every_replica(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, redis_url, redis_prefix, n=2) as fleet:
        r0, r1 = fleet
        path = r0.config  # the file both read
        path.write_text(path.read_text().replace("canary = 0 }", "canary = 25 }"))
        assert r0.proc is not None
        r0.proc.send_signal(signal.SIGHUP)
        for r in fleet:
            await poll(
                lambda r=r: fleet.alias(r),
                lambda w: w == {"stable": 100.0, "canary": 25.0},
                what=f"{r.name} reloaded",
            )
        trail = (await fleet.read(r1, "/admin/changes"))["changes"]
        assert [(c["path"], c["caller"], c["replica"]) for c in trail] == [
            ("/admin/reload", "SIGHUP", "r0")
        ]


async def test_a_key_made_through_one_replica_works_everywhere_and_a_revoked_one_nowhere(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, redis_url, redis_prefix, auth=True) as fleet:
        r0, r1, r2 = fleet
        status, headers, doc = await fleet.change(r1, "POST", "/admin/keys", {"name": "team-a"})
        assert (status, headers["X-Gateway-Replicas"]) == (200, "3/3")  # within 1 s everywhere
        key = doc["key"]
        assert key.startswith("sk-gw-")
        for r in fleet:
            assert await fleet.status_with(r, key) == 200
        # The log holds the key's hash, never the key.
        async with fleet.session.get(r0.admin + "/admin/changes", headers=AUTH) as resp:
            assert key not in await resp.text()
        listed = {k["name"]: k for k in (await fleet.read(r2, "/admin/keys"))["keys"]}
        assert listed["team-a"]["source"] == "runtime"
        assert listed["ops"]["source"] == "config"
        status, headers, _ = await fleet.change(r2, "DELETE", "/admin/keys/team-a")
        assert (status, headers["X-Gateway-Replicas"]) == (200, "3/3")
        for r in fleet:
            assert await fleet.status_with(r, key) == 401
            assert await fleet.status_with(r, OPS_KEY) == 200
        # A key given by its hash (made elsewhere) works the same; a restart keeps it.
        own = "sk-made-by-the-operator"
        status, _, doc = await fleet.change(
            r0, "POST", "/admin/keys", {"name": "team-b", "hash": hash_key(own), "tier": "default"}
        )
        assert status == 200
        assert "key" not in doc
        await r1.stop()
        await r1.start()
        assert await fleet.status_with(r1, own) == 200
        assert await fleet.status_with(r1, key) == 401
        # Rotated through one replica with an overlap: old and new work everywhere until it
        # ends; then only the new.
        status, headers, doc = await fleet.change(
            r2, "POST", "/admin/keys/team-b/rotate", {"overlap_seconds": 2}
        )
        assert (status, headers["X-Gateway-Replicas"]) == (200, "3/3")
        new = doc["key"]
        assert "previous_until" in doc
        for r in fleet:
            assert await fleet.status_with(r, new) == 200
            assert await fleet.status_with(r, own) == 200
        for r in fleet:
            await poll(lambda r=r: fleet.status_with(r, own), lambda s: s == 401, what="overlap")
            assert await fleet.status_with(r, new) == 200
        # Labels and an expiry, as listed by another replica.
        status, _, doc = await fleet.change(
            r0,
            "POST",
            "/admin/keys",
            {"name": "team-c", "labels": {"team": "search"}, "expires_at": "2999-01-01T00:00:00Z"},
        )
        assert status == 200
        listed = {k["name"]: k for k in (await fleet.read(r1, "/admin/keys"))["keys"]}
        assert listed["team-c"]["labels"] == {"team": "search"}
        assert listed["team-c"]["expires_at"] == "2999-01-01T00:00:00Z"
        assert await fleet.status_with(r2, doc["key"]) == 200


async def test_a_lora_adapter_loaded_through_one_replica_is_routed_by_all_at_once(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Loaded once on the backends, recorded in the log: the other replicas route to it
    before their next read of the backends' models (10 s away here)."""
    async with running_fleet(tmp_path, redis_url, redis_prefix) as fleet:
        r0, r1, r2 = fleet
        load = {"lora_name": "sql", "lora_path": "/adapters/sql", "model": "m"}
        status, headers, doc = await fleet.change(r0, "POST", "/admin/lora/load", load)
        assert (status, headers["X-Gateway-Replicas"]) == (200, "3/3"), doc
        assert sorted(doc["loaded"]) == ["a", "b", "c"]
        assert all("sql" in f.models for f in fleet.fakes.values())  # loaded once each
        for r in (r1, r2):
            assert sum((await fleet.send(r, 3, "sql")).values()) == 3
        [record] = (await fleet.read(r2, "/admin/changes"))["changes"]
        assert (record["path"], record["replica"]) == ("/admin/lora/applied", "r0")
        assert record["new"]["backends"] == ["a", "b", "c"]
        status, headers, doc = await fleet.change(
            r1, "POST", "/admin/lora/unload", {"lora_name": "sql", "backends": ["a", "b"]}
        )
        assert (status, headers["X-Gateway-Replicas"]) == (200, "3/3"), doc
        assert await fleet.send(r2, 3, "sql") == {"a": 0, "b": 0, "c": 3}
        # Not routed on the admin API: only the gateway records what it did.
        status, _, doc = await fleet.change(r0, "POST", "/admin/lora/applied", {})
        assert (status, doc["error"]["type"]) == (404, "not_found_error")
