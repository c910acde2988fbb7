"""A replica's figures read from the gateway's own metrics and the limiter's rejections, kept
small whatever names clients make it count, and summed over replicas (mid-upgrade, with
buckets that differ, too)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from prometheus_client.core import Metric

from gateway.fleet.figures import (
    MAX_ALIASES,
    MAX_BACKENDS,
    MAX_KEYS,
    MAX_POOLS,
    OTHER,
    Figures,
    PoolCounts,
    capped,
    quantile,
    read,
    sum_buckets,
    total,
)
from gateway.fleet.registry import Report
from gateway.observe.metrics import LATENCY_BUCKETS, GatewayMetrics

INF = float("inf")


def families(m: GatewayMetrics) -> list[Metric]:
    pools = [m.pool_requests, m.pool_errors, m.pool_ttft, m.pool_itl]
    return [*m.requests.collect(), *m.ttft.collect(), *(f for p in pools for f in p.collect())]


def test_figures_are_read_from_the_gateways_metrics_and_rejections() -> None:
    m = GatewayMetrics()
    for backend, status, endpoint, n in (
        ("a", "200", "chat", 5),
        ("b", "200", "completions", 3),
        ("b", "502", "chat", 2),
        ("none", "429", "chat", 4),  # refused before any backend: not a routing decision
        ("none", "503", "chat", 1),
    ):
        for _ in range(n):
            m.requests.labels("m", backend, status, endpoint).inc()
    for ttft, backend in ((0.02, "a"), (0.3, "a"), (0.3, "b"), (12.0, "b")):
        m.ttft.labels("m", backend).observe(ttft)
    for pool, n in (("stable", 4), ("canary", 1)):
        for _ in range(n):
            m.record_pool("chat", pool, 200, "complete", ttft=None, itl=None)
    rejections = Counter({("web", "requests"): 3, ("web", "budget"): 1, ("batch", "tokens"): 2})

    f = read(families(m), rejections)
    assert (f.requests, f.errors) == (15, 3)
    assert f.decisions == {"a": 5, "b": 5}
    assert f.rejections == {"batch": 2, "web": 4}
    assert f.canary == {"chat": {"canary": 1, "stable": 4}}
    assert [le for le, _ in f.ttft] == [*LATENCY_BUCKETS, INF]  # summed over models, backends
    assert dict(f.ttft)[0.025] == 1
    assert dict(f.ttft)[0.35] == 3
    assert dict(f.ttft)[INF] == 4
    assert f.quantile(0.5) == pytest.approx(0.25 + 0.1 * (2 - 1) / 2)
    assert read([], {}) == Figures()


def test_what_clients_make_the_gateway_count_cannot_grow_a_report() -> None:
    m = GatewayMetrics()
    long = "x" * 52  # names of 61 to 64 characters
    for i in range(200):
        m.requests.labels("m", f"{long}-backend-{i:03d}", "200", "chat").inc(i + 1)
        for j in range(30):  # times across every bucket: no bound left out as idle
            m.record_pool(
                f"{long}-alias-{i % 40:02d}",
                f"{long}-pool-{i:03d}",
                200,
                "ok",
                ttft=0.001 * 1.5**j,
                itl=0.0005 * 1.4**j,
            )
    rejections = Counter({(f"{long}-key-{i:03d}", "requests"): i + 1 for i in range(500)})

    f = read(families(m), rejections)
    assert len(f.rejections) == MAX_KEYS + 1
    assert len(f.decisions) == MAX_BACKENDS + 1
    assert len(f.canary) <= MAX_ALIASES + 1
    assert all(len(pools) <= MAX_POOLS + 1 for pools in f.canary.values())
    # Nothing is lost, only folded: the counts still add up.
    assert sum(f.rejections.values()) == sum(rejections.values())
    assert sum(f.decisions.values()) == f.requests == sum(range(1, 201))
    assert sum(n for pools in f.canary.values() for n in pools.values()) == 200 * 30
    # The keys refused most are the ones named.
    assert min(n for k, n in f.rejections.items() if k != OTHER) == 500 - MAX_KEYS + 1
    assert f.rejections[f"{long}-key-499"] == 500
    # A name longer than any key's is cut, not kept whole.
    assert read([], Counter({("y" * 300, "requests"): 1})).rejections == {"y" * 72: 1}
    encoded = Report("r0", "1.0", "h:1", "1-0", 0.0, 0.0, figures=f).encode()
    # At most: names of 72 characters, and MAX_ALIASES x MAX_POOLS pools each with two full
    # histograms (the gates' figures, ``pools``): about 19 KB. A fleet of short names and one
    # rollout reports well under 2 KB.
    assert len(encoded) < 20 * 1024
    assert len(f.pools) <= MAX_ALIASES
    assert all(len(pools) <= MAX_POOLS for pools in f.pools.values())
    assert OTHER not in f.pools


def test_capped_keeps_the_largest_and_folds_the_rest_under_other() -> None:
    assert capped({"a": 5, "b": 1, "c": 3}, 2) == {"a": 5, "c": 3, OTHER: 1}
    assert capped({"a": 5, "b": 1}, 2) == {"a": 5, "b": 1}
    assert capped({"a": 5, OTHER: 4, "b": 1}, 1) == {"a": 5, OTHER: 5}  # summed caps again
    assert capped({"b": 2, "a": 2, "c": 2}, 2) == {"a": 2, "b": 2, OTHER: 2}  # ties: by name


def test_summed_buckets_of_replicas_with_different_bounds_stay_cumulative() -> None:
    old = ((0.1, 2), (1.0, 5), (INF, 6))
    new = ((0.1, 1), (0.5, 3), (1.0, 4), (INF, 4))
    summed = sum_buckets([old, new, ()])
    # At 0.5 the old replica knows of 2 (those within 0.1), not 5.
    assert summed == ((0.1, 3), (0.5, 5), (1.0, 9), (INF, 10))
    counts = [n for _, n in summed]
    assert counts == sorted(counts)
    assert quantile(summed, 0.5) == pytest.approx(0.5 + 0.5 * (5 - 5) / 4)
    assert quantile((), 0.5) is None
    assert total([]) == Figures()


def test_the_fleets_canary_split_folds_past_its_largest_aliases() -> None:
    per_replica = [
        Figures(canary={f"alias-{i}": {"stable": 10 - i, "canary": 1}}) for i in range(10)
    ]
    summed = total(per_replica).canary
    assert len(summed) == MAX_ALIASES + 1
    assert summed["alias-0"] == {"canary": 1, "stable": 10}
    # The four least used aliases, their pools folded too: 4 x (stable + canary).
    assert summed[OTHER] == {OTHER: sum(10 - i + 1 for i in range(6, 10))}


def test_a_pools_counts_are_read_and_summed_for_the_gates_losing_no_quantile() -> None:
    """What a rollout's gates read: per alias and pool, requests, errors (5xx or a stream
    broken after it began) and both latencies' buckets; idle stretches of buckets are left
    out of a report, and the fleet's quantiles come out as if they were not."""
    replicas = [GatewayMetrics(), GatewayMetrics()]
    full = GatewayMetrics()  # both replicas' requests in one: the quantiles to match
    for m, ttfts in zip(replicas, ([0.03, 0.04, 0.6], [0.05, 2.5]), strict=True):
        for into in (m, full):
            for ttft in ttfts:
                into.record_pool("chat", "v2", 200, "complete", ttft=ttft, itl=ttft / 10)
            into.record_pool("chat", "v2", 502, "upstream_error", ttft=None, itl=None)
            into.record_pool("chat", "v2", 200, "upstream_error", ttft=0.04, itl=None)
            into.record_pool("chat", "v1", 200, "complete", ttft=0.02, itl=0.01)
    read_each = [read(families(m), {}) for m in replicas]
    one = read_each[0].pools["chat"]["v2"]
    assert (one.requests, one.errors) == (5, 2)
    assert len(one.ttft) < len(LATENCY_BUCKETS)  # the idle bounds are left out
    parsed = [Figures.parse(json.loads(json.dumps(f.doc()))) for f in read_each]  # reports
    assert parsed == read_each
    fleet = total(parsed).pools["chat"]
    whole = read(families(full), {}).pools["chat"]
    assert (fleet["v2"].requests, fleet["v2"].errors) == (5 + 4, 2 + 2)
    assert fleet["v1"].requests == 2
    for q in (0.1, 0.5, 0.9, 0.99):
        assert quantile(fleet["v2"].ttft, q) == pytest.approx(quantile(whole["v2"].ttft, q))
        assert quantile(fleet["v2"].itl, q) == pytest.approx(quantile(whole["v2"].itl, q))


def test_a_window_is_the_difference_of_two_readings_even_where_bounds_were_left_out() -> None:
    m = GatewayMetrics()
    m.record_pool("chat", "v2", 200, "complete", ttft=0.03, itl=0.01)
    then = read(families(m), {}).pools["chat"]["v2"]
    for ttft in (0.03, 0.7, 0.7):
        m.record_pool("chat", "v2", 200, "complete", ttft=ttft, itl=0.01)
    m.record_pool("chat", "v2", 503, "complete", ttft=None, itl=None)
    now = read(families(m), {}).pools["chat"]["v2"]
    window = now.since(then)
    assert (window.requests, window.errors) == (4, 1)
    fresh = GatewayMetrics()  # only the window's requests
    for ttft in (0.03, 0.7, 0.7):
        fresh.record_pool("chat", "v2", 200, "complete", ttft=ttft, itl=0.01)
    alone = read(families(fresh), {}).pools["chat"]["v2"]
    for q in (0.2, 0.5, 0.99):
        assert quantile(window.ttft, q) == pytest.approx(quantile(alone.ttft, q))


def test_counts_that_went_back_are_all_the_windows() -> None:
    then = PoolCounts(100, 10, ((0.05, 50), (0.5, 100), (INF, 100)))
    now = PoolCounts(7, 2, ((0.5, 2), (INF, 2)))  # the replica restarted: counting from 0
    assert now.since(then) == now
    grown = PoolCounts(130, 10, ((0.05, 50), (0.5, 100), (INF, 130)))  # 30 more, all slow
    window = grown.since(then)
    assert (window.requests, window.errors) == (30, 0)
    assert dict(window.ttft) == {0.05: 0, 0.5: 0, INF: 30}
