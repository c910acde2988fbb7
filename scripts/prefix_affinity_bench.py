"""Compare routing policies on a prefix scenario, checking issue 9's "Done when" figures.

Runs a load-test scenario (default ``prefix-affinity``) under each policy, as
``llm-gateway loadtest compare`` does, and meanwhile samples every backend's in-flight count
from the gateway's admin API every 100 ms, which ``compare`` cannot see. Writes, in ``--out``:
``result.json`` and ``plot.png`` (the load tester's), ``affinity.json`` (hit rates, in-flight
spread, the checks) and ``affinity.png`` (hit rate and in-flight spread per policy).

    .venv/bin/python scripts/prefix_affinity_bench.py --out runs/prefix-affinity
    .venv/bin/python scripts/prefix_affinity_bench.py prefix-affinity-chat --out runs/pa-chat
    .venv/bin/python scripts/prefix_affinity_bench.py prefix-affinity-replicas \
        --env GATEWAY_AFFINITY__PLACEMENT=room --out runs/pa-replicas-room

With several gateway replicas (``[gateway] replicas``), the in-flight counts are the first
replica's: its own requests, half or less of each backend's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import secrets
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest import procs
from loadtest.cli import progress, show
from loadtest.client import run
from loadtest.report import LabeledRun
from loadtest.scenario import Scenario, load_scenario, run_scenario
from loadtest.stats import percentile

POLICIES = ("prefix_affinity", "least_load", "round_robin")
ABS_ENV = "GATEWAY_AFFINITY__BALANCE_ABS"


async def sample_in_flight(
    url: str,
    token: str,
    samples: list[tuple[float, list[int]]],
    last_metrics: list[str],
    stop: asyncio.Event,
) -> None:
    """Every 100 ms: (time, in-flight per backend) from /admin/backends; until ``stop``.

    Stopped by an event, not by cancellation: aiohttp may turn a cancellation that lands
    in a connect into a timeout error, which the loop below would swallow.
    """
    headers = {"Authorization": f"Bearer {token}"}
    t0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=1.0)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as s:
        tick = 0
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                async with s.get(url + "/admin/backends") as r:
                    doc = await r.json()
                samples.append((time.monotonic() - t0, [b["in_flight"] for b in doc["backends"]]))
                if tick % 10 == 0:
                    async with s.get(url + "/admin/metrics") as r:
                        last_metrics[:] = [await r.text()]
            tick += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)  # the sampling period


async def one_run(
    sc: Scenario, policy: str, out: Path
) -> tuple[LabeledRun, list[tuple[float, list[int]]], str]:
    token = secrets.token_hex(8)
    port = procs.free_port()
    env = {**sc.gateway_env, "GATEWAY_ADMIN__TOKEN": token, "GATEWAY_ADMIN__PORT": str(port)}
    scenario = dataclasses.replace(sc, gateway_env=env)
    samples: list[tuple[float, list[int]]] = []
    metrics: list[str] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(
        sample_in_flight(f"http://127.0.0.1:{port}", token, samples, metrics, stop)
    )
    try:
        with progress(f"{sc.name} / {policy}") as on_tick:
            labeled = await run_scenario(scenario, policy, out, on_tick=on_tick)
    finally:
        stop.set()
        await sampler
    return labeled, samples, metrics[0] if metrics else ""


def spread_figures(
    samples: list[tuple[float, list[int]]], warmup: float, abs_t: float, rel_t: float
) -> dict[str, Any]:
    """In-flight max - min over the samples taken while the load ran (after the warm-up)."""
    busy = [(t, f) for t, f in samples if f and sum(f) > 0]
    if not busy:
        return {"samples": 0}
    start = busy[0][0] + warmup
    window = [f for t, f in busy if t >= start] or [f for _, f in busy]
    spreads = sorted(max(f) - min(f) for f in window)
    within = sum(1 for f in window if max(f) - min(f) <= abs_t or max(f) <= min(f) * rel_t)
    return {
        "samples": len(window),
        "spread_p50": round(percentile(spreads, 50), 1),
        "spread_p99": round(percentile(spreads, 99), 1),
        "spread_max": spreads[-1],
        "within_share": within / len(window),
        "mean_in_flight": [
            round(sum(f[i] for f in window) / len(window), 2) for i in range(len(window[0]))
        ],
    }


def decisions(metrics_text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    prefix = "llm_gateway_prefix_affinity_decisions_total{reason="
    for line in metrics_text.splitlines():
        if line.startswith(prefix):
            reason = line[len(prefix) + 1 : line.index('"', len(prefix) + 1)]
            out[reason] = float(line.split()[-1])
    return out


def hit_rate(run: LabeledRun, window: str = "measured") -> float:
    """Prefix-cache hits / queries (tokens) summed over the backends, from their own metrics.

    ``measured``: from the end of the warm-up on, like every other figure; ``metrics``: the
    whole run, the cold start included.
    """
    counters = [b[window] or {} for b in run.extra["backends"]]
    hits = sum(m.get("vllm:prefix_cache_hits_total", 0.0) for m in counters)
    queries = sum(m.get("vllm:prefix_cache_queries_total", 0.0) for m in counters)
    return hits / queries if queries else 0.0


def plot(
    rows: list[dict[str, Any]],
    series: dict[str, list[tuple[float, int]]],
    path: Path,
    guard: float,
) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    hit_ax, ttft_ax, spread_ax = fig.subplots(1, 3, width_ratios=[1, 1.2, 2])
    labels = [r["policy"] for r in rows]
    hit_ax.bar(labels, [r["hit_rate"] * 100 for r in rows], color=["C0", "C1", "C2"][: len(rows)])
    hit_ax.set(ylabel="%", title="prefix-cache hit rate (backends' metrics)")
    hit_ax.tick_params(axis="x", labelsize="small", labelrotation=15)
    width = 0.38
    xs = range(len(rows))
    ttft_ax.bar([x - width / 2 for x in xs], [r["ttft_p50_ms"] for r in rows], width, label="p50")
    ttft_ax.bar([x + width / 2 for x in xs], [r["ttft_p99_ms"] for r in rows], width, label="p99")
    ttft_ax.set_xticks(list(xs), labels, fontsize="small", rotation=15)
    ttft_ax.set(ylabel="ms", title="time to first token")
    ttft_ax.legend(fontsize="small")
    for policy, points in series.items():
        spread_ax.plot([t for t, _ in points], [s for _, s in points], label=policy, lw=0.9)
    spread_ax.axhline(guard, color="k", ls="--", lw=0.8, label=f"balance_abs = {guard:g}")
    spread_ax.set(
        xlabel="time since start (s)",
        ylabel="requests",
        title="in-flight spread: busiest - idlest backend (every 100 ms)",
    )
    spread_ax.legend(fontsize="small")
    for ax in (hit_ax, ttft_ax, spread_ax):
        ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


Row = dict[str, Any]
Series = dict[str, list[tuple[float, int]]]


async def run_all(
    sc: Scenario, policies: list[str], out: Path
) -> tuple[list[LabeledRun], list[Row], Series]:
    env = sc.gateway_env
    abs_t = float(env.get(ABS_ENV, 8.0))
    rel_t = float(env.get("GATEWAY_AFFINITY__BALANCE_REL", 1.5))
    runs: list[LabeledRun] = []
    rows: list[Row] = []
    series: Series = {}
    for policy in policies:
        labeled, samples, metrics_text = await one_run(sc, policy, out)
        runs.append(labeled)
        s = labeled.summary
        rows.append(
            {
                "policy": policy,
                "hit_rate": hit_rate(labeled),
                "hit_rate_with_warmup": hit_rate(labeled, "metrics"),
                "ttft_p50_ms": s.ttft.p50 * 1e3,
                "ttft_p99_ms": s.ttft.p99 * 1e3,
                "req_per_s": s.request_throughput,
                "tok_per_s": s.output_throughput,
                "ok": s.ok,
                "errors": s.errors,
                "in_flight": spread_figures(samples, sc.load.warmup, abs_t, rel_t),
                "decisions": decisions(metrics_text),
            }
        )
        t0 = samples[0][0] if samples else 0.0
        series[policy] = [(t - t0, max(f) - min(f)) for t, f in samples if f]
    return runs, rows, series


def checks_of(rows: list[Row]) -> dict[str, Any]:
    by = {r["policy"]: r for r in rows}
    if "prefix_affinity" not in by or "least_load" not in by:
        return {}
    pa, ll = by["prefix_affinity"], by["least_load"]
    others = [r for r in rows if r["policy"] != "prefix_affinity"]
    return {
        "hit_rate_vs_least_load": pa["hit_rate"] / ll["hit_rate"] if ll["hit_rate"] else None,
        "hit_rate_at_least_2x": pa["hit_rate"] >= 2 * ll["hit_rate"],
        "lower_ttft_p50": all(pa["ttft_p50_ms"] < r["ttft_p50_ms"] for r in others),
        "lower_ttft_p99": all(pa["ttft_p99_ms"] < r["ttft_p99_ms"] for r in others),
        "higher_throughput": all(pa["tok_per_s"] > r["tok_per_s"] for r in others),
        "in_flight_within_spread_share": pa["in_flight"].get("within_share"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenario", nargs="?", default="prefix-affinity")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--out", type=Path, default=Path("runs/prefix-affinity"))
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a gateway setting over the scenario's, e.g. GATEWAY_AFFINITY__PLACEMENT=hash",
    )
    args = p.parse_args()
    sc = load_scenario(args.scenario)
    extra = dict(item.split("=", 1) for item in args.env)
    if extra:
        sc = dataclasses.replace(sc, gateway_env={**sc.gateway_env, **extra})
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    runs, rows, series = run(run_all(sc, args.policies.split(","), out))
    show(
        runs, out, f"{sc.name}: {sc.load.describe()}", scenario=sc.name, description=sc.description
    )
    checks = checks_of(rows)
    doc = {"scenario": sc.name, "load": sc.load.describe(), "policies": rows, "checks": checks}
    (out / "affinity.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(rows, series, out / "affinity.png", float(sc.gateway_env.get(ABS_ENV, 8.0)))
    for r in rows:
        f = r["in_flight"]
        print(
            f"{r['policy']:16} hit {r['hit_rate']:6.1%} ({r['hit_rate_with_warmup']:.1%})  "
            f"TTFT p50 {r['ttft_p50_ms']:7.1f} "
            f"p99 {r['ttft_p99_ms']:7.1f} ms  {r['req_per_s']:5.2f} req/s "
            f"{r['tok_per_s']:6.0f} tok/s  spread p50 {f.get('spread_p50')} "
            f"p99 {f.get('spread_p99')} max {f.get('spread_max')} "
            f"within {f.get('within_share', 0):.1%}  {r['decisions'] or ''}"
        )
    print(json.dumps(checks))
    print(f"figures: {out / 'affinity.json'}  plot: {out / 'affinity.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
