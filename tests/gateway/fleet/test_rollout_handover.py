"""A progressive rollout driven by a fleet of real replicas on a real Redis: one replica drives
it (the lease), it is killed mid-way, another takes over from the step the log records and
finishes it, and every step was made once (the record every replica applied from the log)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from tests.gateway.fleet.replicas import ALIAS, Fleet, Replica, chat, poll, running_fleet

PLAN: dict[str, Any] = {
    "stable": "stable",
    "canary": "canary",
    "steps": [10, 50, 100],
    "hold_s": 1.0,
    "min_requests": 4,
    # The fakes answer at once: latency gates wide open; errors would abort. The probes make
    # a turn long (each sent to both pools): the driver must keep its lease through them.
    "gates": {
        "error_margin": 0.05,
        "ttft_p99_factor": 1000,
        "itl_p50_factor": 1000,
        "min_agreement": 0.9,
    },
    "probes": ["one", "two", "three"],
}


@asynccontextmanager
async def traffic(fleet: Fleet, replicas: list[Replica]) -> AsyncIterator[list[int]]:
    """Chat requests for the alias spread over ``replicas`` until the block ends."""
    statuses: list[int] = []

    async def send() -> None:
        while True:
            replica = random.choice(replicas)
            with contextlib.suppress(OSError):  # aiohttp's errors are OSErrors
                async with fleet.session.post(
                    replica.url + "/v1/chat/completions", json=chat(ALIAS)
                ) as r:
                    await r.read()
                    statuses.append(r.status)

    tasks = [asyncio.create_task(send()) for _ in range(3)]
    try:
        yield statuses
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def rollout(fleet: Fleet, replica: Replica) -> Any:
    return await fleet.read(replica, f"/admin/rollouts/{ALIAS}")


async def test_the_driver_killed_mid_way_another_finishes_every_step_once(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with running_fleet(
        tmp_path, redis_url, redis_prefix, n=3, rollout={"drive_every": 0.1, "lease_ttl": 1.0}
    ) as fleet:
        status, _, doc = await fleet.change(fleet[1], "POST", f"/admin/rollouts/{ALIAS}", PLAN)
        assert status == 200, doc
        async with traffic(fleet, list(fleet)):
            views = await poll(
                lambda: asyncio.gather(*(rollout(fleet, r) for r in fleet)),
                lambda vs: any(v["driven_here"] for v in vs) and vs[0]["step"] >= 1,
                within=60,
                what="the rollout past its first step, driven by one replica",
            )
            # Held where it is while every replica is looked at
            status, _, doc = await fleet.change(fleet[2], "POST", f"/admin/rollouts/{ALIAS}/pause")
            assert status == 200, doc
        drivers = [r for r, v in zip(fleet, views, strict=True) if v["driven_here"]]
        assert len(drivers) == 1  # exactly one replica drives it
        [driver] = drivers
        # Every replica shows the driver's last look (its report carries it), not only the
        # driver: the gates' figures, the canary's requests, the hold left.
        views = await poll(
            lambda: asyncio.gather(*(rollout(fleet, r) for r in fleet)),
            lambda vs: all(
                v.get("now", {}).get("why") == "paused" and v["driven_by"] == driver.name
                for v in vs
            ),
            within=30,
            what="the driver's look at the paused rollout on every replica",
        )
        for v in views:
            gates = {r["gate"] for r in v["now"]["readings"]}
            assert {"errors", "ttft_p99", "itl_p50"} <= gates, gates
            assert v["now"]["verdict"] == "hold"
            assert v["now"]["canary_requests"] >= 0
            assert 0 <= v["now"]["hold_left_s"] <= PLAN["hold_s"]
        assert sum(v["driven_here"] for v in views) == 1
        status, _, doc = await fleet.change(fleet[0], "POST", f"/admin/rollouts/{ALIAS}/resume")
        assert status == 200, doc
        await driver.kill()
        survivors = [r for r in fleet if r is not driver]
        async with traffic(fleet, survivors) as statuses:
            done = await poll(
                lambda: rollout(fleet, survivors[0]),
                lambda v: v["status"] == "promoted",
                within=90,
                what="promoted by a survivor",
            )
        assert set(statuses) == {200}
        steps = [(e["action"], e["step"]) for e in done["history"]]
        assert steps == [
            ("start", 0),
            ("advance", 1),
            ("pause", 1),
            ("resume", 1),
            ("advance", 2),
            ("promote", 2),
        ]
        # Two drivers made them: the killed one's token, then its successor's, greater.
        tokens = [int(e["by"].split()[1]) for e in done["history"] if e["by"].startswith("driver")]
        assert tokens == sorted(tokens)
        assert len(set(tokens)) == 2  # handed over once: the killed driver's, its successor's
        for replica in survivors:  # every replica applied the same record from the log
            view = await rollout(fleet, replica)
            assert view["history"] == done["history"]
            assert await fleet.alias(replica) == {"canary": 100.0}
        alive = await asyncio.gather(*(rollout(fleet, r) for r in survivors))
        assert sum(v["driven_here"] for v in alive) <= 1
        assert driver.events("rollout_promoted") == []
        promoted = [e for r in survivors for e in r.events("rollout_promoted")]
        assert len(promoted) == 1
