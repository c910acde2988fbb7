"""A progressive rollout defined in the configuration file, run by a fleet of real replicas on a
real Redis: started once for the fleet (not once per replica, and not again when they restart),
and a changed plan in one replica's file started once more."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.gateway.fleet.replicas import ALIAS, Fleet, poll, running_fleet, toml_value
from tests.gateway.fleet.test_rollout_handover import rollout, traffic

# The fakes answer at once: latency gates wide open; errors would abort.
PLAN: dict[str, Any] = {
    "stable": "stable",
    "canary": "canary",
    "steps": [50, 100],
    "hold_s": 0.5,
    "min_requests": 2,
    "gates": {"error_margin": 0.05, "ttft_p99_factor": 1000, "itl_p50_factor": 1000},
}
SETTINGS: dict[str, Any] = {"drive_every": 0.1, "lease_ttl": 1.0}
CONFIGURED = f"/admin/rollouts/{ALIAS}/configured"


async def promoted(fleet: Fleet, stable: str) -> Any:
    """The fleet's rollout, once the plan from ``stable`` is promoted (read from replica 0)."""
    async with traffic(fleet, list(fleet)):
        return await poll(
            lambda: rollout(fleet, fleet[0]),
            lambda v: v["plan"]["stable"] == stable and v["status"] == "promoted",
            within=60,
            what=f"the configured rollout from {stable} promoted",
        )


async def configured_starts(fleet: Fleet) -> list[dict[str, Any]]:
    changes = (await fleet.read(fleet[0], "/admin/changes?limit=200"))["changes"]
    return [c for c in changes if c["path"] == CONFIGURED]


async def test_a_configured_plan_runs_once_for_the_fleet_and_a_changed_one_once_more(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    settings = {**SETTINGS, "plans": {ALIAS: PLAN}}
    async with running_fleet(
        tmp_path, redis_url, redis_prefix, n=2, rollout=settings, compact_every=16
    ) as fleet:
        done = await promoted(fleet, "stable")
        assert [(e["action"], e["by"]) for e in done["history"] if e["action"] == "start"] == [
            ("start", "configuration")
        ]
        for replica in fleet:  # the same record everywhere, the alias the canary's
            assert (await rollout(fleet, replica))["history"] == done["history"]
            assert await fleet.alias(replica) == {"canary": 100.0}
        [start] = await configured_starts(fleet)  # one start, for the whole fleet
        assert start["caller"] == "configuration"
        # More changes than the log keeps: the replicas restart from its snapshot, which must
        # carry the plans started (a replica of the version before reads it too).
        for i in range(20):
            verb = "drain" if i % 2 == 0 else "undrain"
            status, _, _ = await fleet.change(fleet[i % 2], "POST", f"/admin/backends/b/{verb}")
            assert status == 200

        async def kept() -> int:
            return len((await fleet.read(fleet[0], "/admin/changes?limit=500"))["changes"])

        await poll(kept, lambda n: n <= 16, what="the log compacted")
        # Both restarted, one with its file unchanged, one with the next version's plan (back
        # the other way): the first plan is not run again, the changed one runs once.
        changed = {**PLAN, "stable": "canary", "canary": "stable"}
        second = tmp_path / "gateway-changed.toml"
        second.write_text(
            fleet[0].config.read_text().replace(toml_value(PLAN), toml_value(changed))
        )
        assert second.read_text() != fleet[0].config.read_text()
        for replica in fleet:
            await replica.stop()
        fleet[1].config = second
        for replica in fleet:
            await replica.start()
        assert all(r.events("fleet_snapshot_restored") for r in fleet)
        done = await promoted(fleet, "canary")
        assert await fleet.alias(fleet[0]) == {"stable": 100.0}
        starts = await configured_starts(fleet)
        assert len(starts) == 1  # the changed plan's (the first one's was compacted away)
        started = [e for r in fleet for e in r.events("rollout_started")]
        assert len(started) == 1  # since the restart: the changed plan's, by one replica
