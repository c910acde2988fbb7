"""Three replicas (real processes) on a real Redis: what each served is in its report, and
``GET /admin/replicas`` on any of them sums the three, once each has reported."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.gateway.fleet.replicas import ALIAS, Fleet, Replica, chat, poll, running_fleet
from tools.fake_vllm import stream_chat


async def stream(fleet: Fleet, replica: Replica, n: int, model: str = "m") -> list[int]:
    """``n`` streamed chat requests through ``replica``, each read to its end: their statuses."""
    statuses = []
    for _ in range(n):
        body = {**chat(model), "stream": True}
        async with fleet.session.post(replica.url + "/v1/chat/completions", json=body) as r:
            await r.read()
            statuses.append(r.status)
    return statuses


async def test_requests_through_each_replica_are_summed_on_every_replica(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, redis_url, redis_prefix) as fleet:
        for fake in fleet.fakes.values():
            fake.behaviour = stream_chat(3)  # streams: their first tokens are timed
        r0, r1, r2 = fleet
        assert await stream(fleet, r0, 3) == [200] * 3
        assert await stream(fleet, r1, 4, ALIAS) == [200] * 4  # counted in the canary split
        assert await stream(fleet, r2, 5) == [200] * 5
        # A model nobody serves: a request, answered 404, routed nowhere.
        assert await stream(fleet, r2, 1, "nope") == [404]
        served = {"r0": 3, "r1": 4, "r2": 6}

        def reported(doc: Any) -> bool:
            return {r["id"]: r["figures"]["requests"] for r in doc["replicas"]} == served

        for replica in fleet:
            doc = await poll(
                lambda replica=replica: fleet.read(replica, "/admin/replicas"),
                reported,
                what=f"every replica's requests reported, as {replica.name} lists them",
            )
            figures = doc["summary"]["figures"]
            assert figures["requests"] == 13
            assert figures["errors"] == 0
            assert sum(figures["decisions"].values()) == 12  # not the one routed nowhere
            assert set(figures["decisions"]) <= {"a", "b", "c"}
            assert figures["canary"] == {ALIAS: {"stable": 4}}
            assert figures["rejections"] == {}
            # The summed buckets count the first token of every request a backend answered,
            # through whichever replica, and give the fleet's quantiles.
            assert figures["ttft"][-1] == [None, 12]
            assert 0 < figures["ttft_p50_s"] <= figures["ttft_p99_s"]
            own = {r["id"]: r["figures"] for r in doc["replicas"]}
            assert [own[r]["ttft"][-1][1] for r in ("r0", "r1", "r2")] == [3, 4, 5]
            assert own["r1"]["canary"] == {ALIAS: {"stable": 4}}
            assert own["r2"]["requests"] == 6
