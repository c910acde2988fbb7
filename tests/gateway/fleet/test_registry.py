"""The registry of replicas on a real Redis (and in files, for the workers of one host):
reports, listing, a replica dropping out when its report expires (Redis's clock, not ours; in
files, an injected one) or when it leaves; what the reports say together, their figures summed."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from backends.errors import InvalidRequest
from gateway.fleet.changes import Position
from gateway.fleet.figures import Figures
from gateway.fleet.files import FileRegistry
from gateway.fleet.registry import RedisRegistry, Report, disagreements, lagging, summary


def report(rid: str, applied: str | None = "5-0", **kw: object) -> Report:
    fields: dict[str, object] = {
        "version": "1.0",
        "address": f"10.0.0.{rid[-1]}:8080",
        "started_at": 100.0,
        "reported_at": 160.0,
    }
    fields.update(kw)
    return Report(id=rid, applied=applied, **fields)  # type: ignore[arg-type]


def test_a_report_survives_its_encoding_and_an_unreadable_one_is_refused() -> None:
    look = {"verdict": "hold", "why": "holding", "hold_left_s": 3.5, "readings": [], "at": 1.0}
    r = report("r1", in_flight={"b0": 2}, health={"b0": "healthy"}, driving={"chat": look})
    assert Report.decode(r.encode()) == r
    older = json.loads(r.encode())
    del older["driving"]  # a replica of a version from before rollouts drives none
    assert Report.decode(json.dumps(older)).driving == {}
    assert r.view(now=190.0)["uptime_s"] == 90.0
    with pytest.raises(InvalidRequest):
        Report.decode('{"id": "r1"}')


INF = float("inf")


def test_a_report_carries_its_figures_and_one_without_them_has_none() -> None:
    figures = Figures(
        requests=7,
        errors=1,
        ttft=((0.1, 3), (1.0, 6), (INF, 6)),
        rejections={"web": 2},
        canary={"chat": {"stable": 5, "canary": 1}},
        decisions={"b0": 6},
    )
    r = report("r1", figures=figures)
    assert Report.decode(r.encode()) == r
    assert '"ttft":[[0.1,3],[1.0,6],[null,6]]' in r.encode()  # JSON has no infinity
    assert r.view(now=190.0)["figures"]["ttft"][-1] == [None, 6]
    # A replica of a version from before the figures: its report still reads, with none.
    older = json.loads(r.encode())
    del older["figures"]
    assert Report.decode(json.dumps(older)).figures == Figures()
    with pytest.raises(InvalidRequest):
        Report.decode(r.encode().replace('"requests":7', '"requests":"many"'))


def test_the_fleets_figures_are_the_replicas_summed() -> None:
    rs = [
        report(
            "r0",
            figures=Figures(
                requests=10,
                errors=1,
                ttft=((0.1, 4), (0.5, 8), (INF, 8)),
                rejections={"web": 3, "batch": 1},
                canary={"chat": {"stable": 6, "canary": 2}},
                decisions={"a": 5, "b": 5},
            ),
        ),
        report(
            "r1",
            figures=Figures(
                requests=20,
                ttft=((0.1, 0), (0.5, 10), (INF, 12)),
                rejections={"web": 2},
                canary={"chat": {"stable": 9, "canary": 1}},
                decisions={"a": 12, "c": 8},
            ),
        ),
        report("r2", figures=Figures(requests=5, errors=2, ttft=((0.1, 0), (0.5, 0), (INF, 0)))),
    ]
    s = summary(rs, Position(5, 0))
    f = s["figures"]
    assert (f["requests"], f["errors"]) == (35, 3)
    assert f["ttft"] == [[0.1, 4], [0.5, 18], [None, 20]]
    assert f["rejections"] == {"batch": 1, "web": 5}
    assert f["canary"] == {"chat": {"canary": 3, "stable": 15}}
    assert f["decisions"] == {"a": 17, "b": 5, "c": 8}
    # The quantiles are the summed buckets', not an average of the replicas': of 20 first
    # tokens 4 came within 0.1 s and 18 within 0.5 s; p50 is the 10th, p99 past the 18th.
    assert f["ttft_p50_s"] == pytest.approx(0.1 + 0.4 * (10 - 4) / (18 - 4), abs=1e-4)
    assert f["ttft_p99_s"] == 0.5  # in the +Inf bucket: its lower bound
    # Each replica's own figures are in its view, with its own quantiles.
    view = rs[0].view(now=200.0)["figures"]
    assert (view["requests"], view["ttft_p50_s"]) == (10, pytest.approx(0.1))
    assert summary([], None)["figures"]["ttft_p50_s"] is None  # nothing yet


def test_replicas_behind_the_log_lag_and_views_that_differ_are_flagged() -> None:
    rs = [
        report("r0", "7-0", health={"b0": "healthy", "b1": "unhealthy"}, in_flight={"b0": 2}),
        report("r1", "6-3", health={"b0": "healthy", "b1": "healthy"}, in_flight={"b0": 1}),
        report("r2", None, health={"b0": "healthy"}, in_flight={"b1": 4}),
    ]
    assert lagging(rs, Position(7, 0)) == ["r1", "r2"]
    assert lagging(rs, None) == []
    assert disagreements(rs) == {"b1": {"r0": "unhealthy", "r1": "healthy"}}
    s = summary(rs, Position(7, 0))
    assert s["in_flight"] == {"b0": 3, "b1": 4}
    assert (s["replicas"], s["head"]) == (3, "7-0")


async def test_replicas_are_listed_until_they_leave(redis: Redis, redis_prefix: str) -> None:
    reg = RedisRegistry(redis, redis_prefix, "f", ttl=60.0)
    for rid in ("r1", "r0"):
        await reg.report(report(rid))
    await reg.report(report("r1", "9-0"))  # a later report replaces the earlier
    assert [(r.id, r.applied) for r in await reg.replicas()] == [("r0", "5-0"), ("r1", "9-0")]
    await reg.leave("r0")
    assert [r.id for r in await reg.replicas()] == ["r1"]
    assert await RedisRegistry(redis, redis_prefix, "other", ttl=60.0).replicas() == []


async def test_a_replica_that_stops_reporting_drops_out_after_its_ttl(
    redis: Redis, redis_prefix: str
) -> None:
    reg = RedisRegistry(redis, redis_prefix, "f", ttl=60.0)
    await reg.report(report("r0"))
    short = RedisRegistry(redis, redis_prefix, "f", ttl=0.05)
    await short.report(report("r9"))

    deadline = time.monotonic() + 10.0  # Redis expires it in 50 ms; the bound is for a slow host
    while [r.id for r in await reg.replicas()] != ["r0"]:
        assert time.monotonic() < deadline, "r9's report never expired"
        await asyncio.sleep(0.01)  # sleep-ok: polling interval of a deadline-bounded wait
    assert await redis.sismember(redis_prefix + "f:replicas", "r9") == 0  # and its id went


async def test_in_files_replicas_are_listed_until_they_leave_or_their_report_is_too_old(
    tmp_path: Path,
) -> None:
    now = [160.0]
    reg = FileRegistry(tmp_path, "f", ttl=6.0, clock=lambda: now[0])
    await reg.report(report("w0"))
    await reg.report(report("host-1/w1", reported_at=158.0))  # an id with a slash: one file
    assert [r.id for r in await reg.replicas()] == ["host-1/w1", "w0"]
    assert await FileRegistry(tmp_path, "other", ttl=6.0).replicas() == []
    now[0] = 165.0  # w1 reported 7 s ago: gone, its file too
    assert [r.id for r in await reg.replicas()] == ["w0"]
    assert len(list(reg.dir.iterdir())) == 1
    await reg.leave("w0")
    assert await reg.replicas() == []
