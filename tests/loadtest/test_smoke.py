"""End to end: a tiny scenario with simulator and gateway subprocesses, a few seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.pool import pool
from loadtest.report import plot, write_json
from loadtest.scenario import parse_scenario, run_scenario

TINY = """
name = "tiny"
policies = ["round_robin"]

[[backends]]
count = 2
args = ["--max-num-seqs", "4", "--sim-step-base-ms", "1", "--sim-prefill-us-per-token", "2",
        "--sim-decode-us-per-seq", "5", "--sim-attention-ns-per-token", "0"]

[workload]
prompt = 8
output = 6
prefix = { groups = 1, length = 32 }

[load]
mode = "closed"
concurrency = 2
requests = 12

[slo]
ttft_ms = 5000

[[events]]
at = 0.0
backend = 1
faults = { slowdown = 2.0 }
"""


async def test_tiny_scenario_runs_end_to_end(tmp_path: Path) -> None:
    sc = parse_scenario(TINY)
    run = await run_scenario(sc, "round_robin", tmp_path)
    s = run.summary
    assert s.ok == 12, s.errors
    assert s.goodput_share == 1.0
    assert s.tokens_out.mean == 6
    backends = run.extra["backends"]
    done = [b["metrics"]["vllm:request_success_total"] for b in backends]
    assert done == [6, 6]  # round robin over two backends
    assert backends[0]["metrics"]["vllm:prefix_cache_hits_total"] > 0
    # The gateway's side is scraped too. Not "== 12": the gateway may skip counting a request
    # whose client closes the connection right after the last byte (reported to the lead).
    assert 0 < run.extra["gateway"]["metrics"]["llm_gateway_requests_total"] <= 12
    assert "***" in run.extra["commands"]["sims"][0]  # the admin token is not recorded
    assert (tmp_path / "logs" / "round_robin" / "gateway.log").exists()
    write_json(tmp_path / "result.json", [run])
    plot([run], tmp_path / "plot.png", "tiny")
    assert (tmp_path / "plot.png").stat().st_size > 10_000
    assert '"label": "round_robin"' in (tmp_path / "result.json").read_text()
    pooled = pool([tmp_path / "result.json", tmp_path / "result.json"])["round_robin"]
    assert len(pooled.ttft_ms) == 24  # every measured request's TTFT is kept, twice
    assert pooled.run_p99s[0] == pytest.approx(s.ttft.p99 * 1e3, abs=0.02)  # as the run's own
    assert max(pooled.ttft_ms) == pytest.approx(s.ttft.max * 1e3, abs=0.01)


async def test_backend_counters_are_also_taken_from_the_end_of_the_warm_up(
    tmp_path: Path,
) -> None:
    sc = parse_scenario(
        TINY.replace("requests = 12", "duration = 1.5\nwarmup = 0.5").replace(
            "[[events]]\nat = 0.0\nbackend = 1\nfaults = { slowdown = 2.0 }\n", ""
        )
    )
    run = await run_scenario(sc, "round_robin", tmp_path)
    whole, measured = (
        [b[window]["vllm:request_success_total"] for b in run.extra["backends"]]
        for window in ("metrics", "measured")
    )
    assert all(0 < m <= w for m, w in zip(measured, whole, strict=True)), (whole, measured)
    # What the client saw end before the warm-up's end was counted by a backend before the
    # scrape there (a simulator counts a request before it sends the last event): none of it
    # is in the measured window. On a machine so slow that nothing ends within the warm-up the
    # bound is zero; the assertion above still holds.
    ended_in_warmup = sum(
        1 for r in run.result.records if r.ok and r.e2e is not None and r.start + r.e2e < 0.5
    )
    assert sum(whole) - sum(measured) >= ended_in_warmup, (whole, measured, ended_in_warmup)
    assert sum(whole) == run.summary.ok + sum(1 for r in run.result.records if r.warmup and r.ok)


async def test_requests_alternate_between_gateway_replicas(tmp_path: Path) -> None:
    sc = parse_scenario(TINY.replace("[[backends]]", "[gateway]\nreplicas = 2\n\n[[backends]]", 1))
    run = await run_scenario(sc, "round_robin", tmp_path)
    assert run.summary.ok == 12
    assert run.extra["gateway"]["replicas"] == 2
    # The first replica's own count: every other request (or one fewer, see above).
    assert 0 < run.extra["gateway"]["metrics"]["llm_gateway_requests_total"] <= 6
    assert (tmp_path / "logs" / "round_robin" / "gateway1.log").exists()


async def test_a_drain_event_stops_every_replica_sending_to_that_backend(tmp_path: Path) -> None:
    """``drain`` acts through each replica's admin API: after backend 1 is drained (t = 1 s)
    neither replica sends it a request (requests alternate between the replicas, so one replica
    left out would still send it a quarter of them), while before it took its share."""
    sc = parse_scenario(
        TINY.replace("[[backends]]", "[gateway]\nreplicas = 2\n\n[[backends]]", 1)
        .replace(
            'mode = "closed"\nconcurrency = 2\nrequests = 12',
            'mode = "open"\nrate = 40.0\nduration = 2.0\nwarmup = 1.5',
        )
        .replace(
            "[[events]]\nat = 0.0\nbackend = 1\nfaults = { slowdown = 2.0 }\n",
            "[[events]]\nat = 1.0\nbackend = 1\naction = 'drain'\n",
        )
    )
    assert [(e.at, e.action) for e in sc.events] == [(1.0, "drain")]
    run = await run_scenario(sc, "round_robin", tmp_path)
    assert not run.summary.errors, run.summary.errors
    whole, measured = (
        [b[window]["vllm:request_success_total"] for b in run.extra["backends"]]
        for window in ("metrics", "measured")
    )
    assert whole[1] > 0  # served before the drain
    # From the end of the warm-up on (t = 1.5 s, or later: it waits until the drain has been
    # applied on both replicas and nothing is in flight to backend 1): nothing to backend 1,
    # everything to backend 0.
    assert measured[1] == 0, (whole, measured)
    assert measured[0] >= 40, (whole, measured)  # about 80 requests in those 2 s
