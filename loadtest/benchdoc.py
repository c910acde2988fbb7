"""``llm-gateway loadtest report-all`` (``make benchmarks``): rerun everything, rewrite the doc.

Runs every bundled scenario under its policies, then the overhead benchmark, and rewrites
``docs/benchmarks.md`` with the figures, the commands that reproduce each one, and the
plots (``docs/img/``); raw results go to ``docs/results/``. About 8 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from loadtest.report import LabeledRun

SCENARIOS: Final = (
    "slow-backend",
    "homogeneous",
    "burst",
    "backend-dies",
    "backend-stalls",
    "shared-prefix",
)
TARGET_RATIO: Final = 0.7  # issue 8: least_load p99 TTFT <= 0.7 x round_robin's in slow-backend


USAGE: Final = (
    "## Running a load test yourself",
    "",
    "```sh",
    "# against any OpenAI-compatible server: open loop, chat-like lengths, goodput SLOs",
    "llm-gateway loadtest run --url http://127.0.0.1:8080 --rate 8 --duration 30 --warmup 5 \\",
    "    --prompt chat --output lognormal:225:0.9:1:1024 --slo-ttft-ms 1000 --slo-itl-ms 100",
    "# closed loop, shared prefixes (8 x 512 tokens, one hot), 3-turn sessions",
    "llm-gateway loadtest run --url http://127.0.0.1:8080 --concurrency 32 --requests 500 \\",
    "    --prefix-groups 8 --prefix-len 512 --hot-share 0.5 --turns 3",
    "llm-gateway loadtest scenario slow-backend --policy least_load   # a scenario file",
    "llm-gateway loadtest compare slow-backend --policies least_load,round_robin,power_of_two",
    "llm-gateway loadtest overhead                                    # the gateway's own cost",
    "make benchmarks                                                  # this page",
    "```",
    "",
    "Each command prints a table and writes `result.json` and `plot.png` (TTFT CDF, TTFT "
    "and throughput over time, runs side by side) under `runs/loadtest/` (`--out` to "
    "choose). Scenario files are in `loadtest/scenarios/` (format: `loadtest/scenario.py`). "
    "The client warns when its own event-loop lag or CPU could distort the figures.",
    "",
)


def _ms(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1e3:,.0f}"


def runs_table(runs: Sequence[LabeledRun]) -> list[str]:
    rows = [
        "| policy | ok | errors | req/s | tok/s | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 "
        "| ITL p99 | TPOT mean | E2E p50 | E2E p99 | goodput |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        s = r.summary
        errors = ", ".join(f"{k} {v}" for k, v in s.errors.items()) or "0"
        goodput = "-" if s.goodput_share is None else f"{s.goodput_share:.0%}"
        rows.append(
            f"| {r.label} | {s.ok} | {errors} | {s.request_throughput:.2f} | "
            f"{s.output_throughput:,.0f} | {_ms(s.ttft.p50)} | {_ms(s.ttft.p90)} | "
            f"{_ms(s.ttft.p99)} | {s.itl.p50 * 1e3:.1f} | {s.itl.p99 * 1e3:.1f} | "
            f"{s.tpot.mean * 1e3:.1f} | {_ms(s.e2e.p50)} | {_ms(s.e2e.p99)} | {goodput} |"
        )
    return rows


def backends_table(runs: Sequence[LabeledRun]) -> list[str]:
    rows = [
        "| policy | backend | options | requests done | prefix-cache hit rate | preemptions "
        "| aborted |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in runs:
        for b in r.extra.get("backends", []):
            m = b["metrics"]
            if m is None:
                rows.append(f"| {r.label} | {b['name']} | `{' '.join(b['args'])}` | killed | | | |")
                continue
            hit = m.get("prefix_cache_hit_rate")
            rows.append(
                f"| {r.label} | {b['name']} | `{' '.join(b['args'])}` | "
                f"{m.get('vllm:request_success_total', 0):.0f} | "
                f"{'-' if hit is None else f'{hit:.0%}'} | "
                f"{m.get('vllm:num_preemptions_total', 0):.0f} | "
                f"{m.get('sim:aborted_requests_total', 0):.0f} |"
            )
    return rows


def gateway_line(runs: Sequence[LabeledRun]) -> list[str]:
    """The gateway's side: its CPU and RSS, and its retry/failover/abort counters."""
    parts = []
    for r in runs:
        gw = r.extra.get("gateway") or {}
        m = gw.get("metrics") or {}

        def n(name: str, m: dict[str, float] = m) -> str:
            return f"{m.get(name, 0):.0f}"

        parts.append(
            f"{r.label}: CPU {gw.get('cpu_s', 0):.1f} s, RSS {gw.get('rss_mb', 0):.0f} MB, "
            f"{n('llm_gateway_requests_total')} requests, "
            f"{n('llm_gateway_retries_total')} retries, "
            f"{n('llm_gateway_failovers_total')} failovers, "
            f"{n('llm_gateway_upstream_aborts_total')} upstream aborts, "
            f"{n('llm_gateway_stream_continuations_total')} mid-stream breaks "
            f"(continued or not), {n('llm_gateway_backend_stalls_total')} backend stalls"
        )
    return ["Gateway (its `/metrics` and `/proc`): " + "; ".join(parts) + ".", ""]


def slow_backend_verdict(runs: Sequence[LabeledRun]) -> list[str]:
    by = {r.label: r.summary for r in runs}
    ll, rr = by.get("least_load"), by.get("round_robin")
    if ll is None or rr is None:
        return ["(least_load or round_robin missing: no verdict)"]
    ratio = ll.ttft.p99 / rr.ttft.p99 if rr.ttft.p99 > 0 else math.nan
    tput = ll.request_throughput / rr.request_throughput if rr.request_throughput else math.nan
    met = ratio <= TARGET_RATIO and tput >= 0.98
    return [
        f"**Target** (issue 8): least_load p99 TTFT at most {TARGET_RATIO} x round_robin's, "
        "no loss of throughput. "
        f"**Measured:** p99 TTFT {_ms(ll.ttft.p99)} ms vs {_ms(rr.ttft.p99)} ms "
        f"(ratio {ratio:.2f}); throughput {ll.request_throughput:.2f} vs "
        f"{rr.request_throughput:.2f} req/s (ratio {tput:.2f}): "
        f"**{'met' if met else 'not met'}**.",
    ]


def _git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" with uncommitted changes" if dirty else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _quick(sc: Any) -> Any:
    """The scenario shortened to a few seconds, events moved to the same relative place."""
    load = sc.load
    total = load.warmup + (load.duration or 0.0)
    new = dataclasses.replace(load, duration=3.0, warmup=1.0)
    scale = 4.0 / total if total else 1.0
    events = tuple(dataclasses.replace(e, at=e.at * scale) for e in sc.events)
    return dataclasses.replace(sc, load=new, events=events)


def _rel(path: Path, doc: Path) -> str:
    try:
        return str(path.resolve().relative_to(doc.parent.resolve()))
    except ValueError:
        return str(path)


def regenerate(doc: Path, img: Path, *, quick: bool = False) -> int:
    from loadtest.bench.overhead import add_arguments, measure, print_report
    from loadtest.cli import progress
    from loadtest.client import run
    from loadtest.report import plot, write_json
    from loadtest.scenario import load_scenario, run_scenario

    began = time.monotonic()
    results = doc.parent / "results"
    work = Path("runs") / "loadtest" / f"report-all-{time.strftime('%Y%m%d-%H%M%S')}"
    lines = [
        "# Benchmarks",
        "",
        "Generated by `make benchmarks` (= `llm-gateway loadtest report-all`); do not edit by "
        "hand. Raw results are in `docs/results/`, plots in `docs/img/`, process logs of the "
        f"last run in `{work}/`.",
        "",
        f"- Run: {time.strftime('%Y-%m-%d %H:%M')}, commit {_git_commit()}"
        + (" (**quick mode: short runs, figures not meaningful**)" if quick else ""),
        f"- Machine: {_cpu_model()}, {len(os.sched_getaffinity(0))} cores, "
        f"Python {platform.python_version()}; shared with other work, so repeat a run before "
        "reading much into differences under ~10 %.",
        "- Definitions (those of vLLM's `benchmark_serving`): TTFT = request sent to the "
        "first SSE event with non-empty text; ITL = every gap between content events, pooled "
        "(events in one read count 0 ms); TPOT = (E2E - TTFT) / (tokens - 1) per request; "
        "goodput = share of requests that succeeded within the TTFT SLO and whose TPOT is "
        "within the ITL SLO. Percentiles interpolate linearly. See `loadtest/stats.py`.",
        "- Scenarios run simulated vLLM backends (`llm-gateway sim`, on simulated time) and "
        "the gateway as subprocesses on this machine; times are in ms.",
        "",
        *USAGE,
    ]
    for name in SCENARIOS:
        sc = load_scenario(name)
        if quick:
            sc = _quick(sc)
        runs = []
        for policy in sc.policies:
            with progress(f"{name} / {policy}") as on_tick:
                runs.append(run(run_scenario(sc, policy, work / name, on_tick=on_tick)))
        title = f"{sc.name}: {sc.load.describe()}"
        write_json(results / f"{name}.json", runs, title=title, description=sc.description)
        plot(runs, img / f"{name}.png", title)
        lines += [
            f"## `{name}`",
            "",
            sc.description,
            "",
            f"Load: {sc.load.describe()}; workload: {sc.workload.endpoint}, prompt "
            f"{sc.workload.prompt.kind} (mean {sc.workload.prompt.mean:.0f}), output "
            f"{sc.workload.output.kind} (mean {sc.workload.output.mean:.0f}) tokens"
            + (
                f", {sc.workload.prefix.groups} shared prefixes of {sc.workload.prefix.length}"
                if sc.workload.prefix.groups
                else ""
            )
            + ". Reproduce: `llm-gateway loadtest compare "
            f"{name} --policies {','.join(sc.policies)}`.",
            "",
            *runs_table(runs),
            "",
            *([*slow_backend_verdict(runs), ""] if name == "slow-backend" else []),
            "Per backend (each simulator's `/metrics` after the run minus before it, warm-up "
            "included):",
            "",
            *backends_table(runs),
            "",
            *gateway_line(runs),
            *[f"> client warning ({r.label}): {r.warning}" for r in runs if r.warning],
            "",
            f"![{name}]({_rel(img / f'{name}.png', doc)})",
            "",
        ]
    p = argparse.ArgumentParser()
    add_arguments(p)
    oargs = p.parse_args(["--levels", "1,64" if quick else "1,64,256,1024"])
    if quick:
        oargs.duration = 1.5
    odoc: dict[str, Any] = run(measure(oargs, work / "overhead"))
    print_report(odoc)
    (results / "overhead.json").write_text(
        (work / "overhead" / "overhead.json").read_text(), encoding="utf-8"
    )
    (img / "overhead.png").write_bytes((work / "overhead" / "overhead.png").read_bytes())
    lines += overhead_section(odoc, doc, img, oargs)
    lines += [
        "",
        f"_Regenerated in {time.monotonic() - began:.0f} s._",
        "",
    ]
    doc.write_text("\n".join(lines))
    print(f"wrote {doc}")
    return 0


def overhead_section(
    odoc: dict[str, Any], doc: Path, img: Path, oargs: argparse.Namespace
) -> list[str]:
    lines = [
        "## Gateway overhead",
        "",
        "The same closed-loop load against two fake backends (`tools/fake_vllm`: paced "
        "token streams, no engine model) directly and through one gateway process "
        f"(policy `{oargs.policy}`, log level info). Gateway pinned to CPU {oargs.gateway_cpu}; "
        f"backends and the load generator to CPU {oargs.client_cpu}; {oargs.duration:g} s per "
        "level. CPU µs/event = the gateway's CPU time (from `/proc/<pid>/stat`) over the "
        "level / content events forwarded. MB/1k streams = (peak RSS in the level - RSS "
        "before it) per 1,000 concurrent streams. Reproduce: `llm-gateway loadtest overhead`.",
        "",
    ]
    for name, prof in odoc["profiles"].items():
        v = odoc["verdict"][name]
        added = v["added_ttft_ms"]
        lines += [
            f"### Profile `{name}`: {prof['what']}",
            "",
            "| target | c | ok | err | TTFT p50 | TTFT p99 | ΔTTFT p50 | ΔTTFT p99 | ITL p99 "
            "| events/s | gateway CPU | CPU µs/event | RSS MB | MB/1k streams |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for target in ("direct", "gateway"):
            for r in prof[target]:
                a = added.get(r["c"], added.get(str(r["c"]), {})) if target == "gateway" else {}

                def f(x: Any, fmt: str) -> str:
                    return "-" if x is None else fmt.format(x)

                lines.append(
                    f"| {target} | {r['c']} | {r['ok']} | "
                    f"{sum(r['errors'].values()) + r['unfinished'] + r['stalls']} | "
                    f"{f(r['ttft_ms']['p50'], '{:.2f}')} | {f(r['ttft_ms']['p99'], '{:.2f}')} | "
                    f"{f(a.get('p50'), '{:+.2f}')} | {f(a.get('p99'), '{:+.2f}')} | "
                    f"{f(r['itl_ms']['p99'], '{:.2f}')} | {r['events_per_s']:,.0f} | "
                    f"{f(r['gateway_cpu_share'], '{:.0%}')} | "
                    f"{f(r['cpu_us_per_event'], '{:.1f}')} | {f(r['rss_mb_peak'], '{:.1f}')} | "
                    f"{f(r['rss_mb_per_1000_streams'], '{:.1f}')} |"
                )
        lines += [
            "",
            f"Highest concurrency with no errors or stalls: {v['highest_clean_concurrency']}.",
            "",
        ]
    lines += [
        f"![overhead]({_rel(img / 'overhead.png', doc)})",
        "",
        "For the side-by-side comparison with nginx, vllm-router, sglang-router and LiteLLM "
        "(issue 8's targets are ratios to vllm-router in the same run), run "
        "`python -m loadtest.peers` (the gateway of this checkout is its target `gw`; runs and "
        "how to reproduce them in `docs/bench/README.md`); this benchmark uses the same "
        "profiles, pinning and definitions, but peers' absolute figures from another run are "
        "not comparable to these.",
        "",
        "Raw: `docs/results/overhead.json`.",
    ]
    return lines
