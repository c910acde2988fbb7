"""Small pure pieces: Prometheus totals, CLI length specs, the overhead verdict."""

from __future__ import annotations

import argparse

import pytest

from loadtest.bench.overhead import verdict
from loadtest.cli import parse_length
from loadtest.promtext import delta, totals
from loadtest.workload import CHAT_PROMPT

PAGE = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 7.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 4.0
"""


def test_totals_sum_label_sets_of_wanted_families_only() -> None:
    t = totals(PAGE)
    assert t["vllm:request_success_total"] == 10.0
    assert t["vllm:prefix_cache_hits_total"] == 300.0
    assert "vllm:e2e_request_latency_seconds_bucket" not in t


def test_delta_subtracts_counters_keeps_gauges_and_adds_hit_rate() -> None:
    before = {"vllm:prefix_cache_hits_total": 100.0, "vllm:prefix_cache_queries_total": 200.0}
    d = delta(before, totals(PAGE))
    assert d["vllm:prefix_cache_hits_total"] == 200.0
    assert d["vllm:num_requests_running"] == 2.0
    assert d["prefix_cache_hit_rate"] == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("spec", "kind", "mean"),
    [("64", "fixed", 64), ("fixed:8", "fixed", 8), ("uniform:10:30", "uniform", 20)],
)
def test_length_specs(spec: str, kind: str, mean: float) -> None:
    d = parse_length(spec)
    assert (d.kind, d.mean) == (kind, mean)


def test_length_spec_presets_and_errors() -> None:
    assert parse_length("chat") == CHAT_PROMPT
    d = parse_length("lognormal:100:0.5:10:900")
    assert (d.median, d.sigma, d.low, d.high) == (100, 0.5, 10, 900)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_length("normal:3")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_length("uniform:9:1")


def row(c: int, p50: float, p99: float, *, clean: bool = True) -> dict[str, object]:
    return {
        "c": c,
        "ttft_ms": {"p50": p50, "p99": p99},
        "clean": clean,
        "cpu_us_per_event": 20.0,
        "rss_mb_per_1000_streams": 30.0,
    }


def test_overhead_verdict_added_ttft_and_highest_clean_level() -> None:
    doc = {
        "profiles": {
            "paced": {
                "direct": [row(1, 20.0, 22.0), row(64, 21.0, 30.0)],
                "gateway": [row(1, 20.5, 23.0), row(64, 22.0, 35.0, clean=False)],
            }
        }
    }
    v = verdict(doc)["paced"]
    assert v["added_ttft_ms"][1] == {"p50": 0.5, "p99": 1.0}
    assert v["added_ttft_ms"][64] == {"p50": 1.0, "p99": 5.0}
    assert v["highest_clean_concurrency"] == 1
