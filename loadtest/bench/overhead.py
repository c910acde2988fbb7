"""What the gateway itself costs: the same load against the backends directly and through it.

Two fake backends (``tools.fake_vllm``: paced token streams, no engine model) and this
load generator share one core (``--client-cpu``, default 1); one gateway process gets the
other (``--gateway-cpu``, default 0), with its whole request path on (routing policy, load
scraping, per-request log line at info level). For each profile and concurrency (closed
loop), the direct run and the gateway run give:

- **added TTFT**: gateway minus direct, at p50 and p99;
- **events/s**: content events (tokens) received per second; every one was forwarded;
- **CPU us/event**: the gateway's CPU time (utime + stime from ``/proc/<pid>/stat``) over
  the level, divided by the content events forwarded in it (role, usage and ``[DONE]``
  events are forwarded too but not counted, as in ``loadtest.peers``);
- **RSS per 1,000 streams**: (peak RSS during the level - RSS before it) / concurrency x 1000;
- **clean**: no errors (a request silent for 10 s is the error "stall"), nothing unfinished,
  and no gap between events above ``--stall-ms``. The report names the highest clean
  concurrency.

Profiles (those of ``loadtest.peers``): ``fast`` (TTFT 0, ITL 0, 256 tokens: events reach
the gateway in bursts, several per read: raw forwarding cost) and ``paced`` (TTFT 20 ms,
ITL 10 ms, 64 tokens: about one event per read; added TTFT and jitter).

Run: ``llm-gateway loadtest overhead`` or ``python -m loadtest.bench.overhead`` (``make bench``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

LEVELS: Final = (1, 64, 256, 1024)


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    ttft_ms: float
    itl_ms: float
    max_tokens: int
    what: str


PROFILES: Final = {
    "fast": Profile("fast", 0.0, 0.0, 256, "TTFT 0, ITL 0, 256 tokens: events in bursts"),
    "paced": Profile("paced", 20.0, 10.0, 64, "TTFT 20 ms, ITL 10 ms, 64 tokens: one per read"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrencies")
    p.add_argument("--profiles", default="fast,paced", help=f"of {', '.join(PROFILES)}")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per level")
    p.add_argument("--policy", default="least_load", help="the gateway's routing policy")
    p.add_argument("--gateway-cpu", type=int, default=0, help="the core the gateway is pinned to")
    p.add_argument("--client-cpu", type=int, default=1, help="also the backends' CPU")
    p.add_argument("--stall-ms", type=float, default=2000.0, help="a gap above this is a stall")
    p.add_argument("--out", type=Path, help="directory for overhead.json and overhead.png")


def main_from_args(args: argparse.Namespace) -> int:
    from loadtest.client import run

    out: Path = args.out or Path("runs") / "loadtest" / f"overhead-{time.strftime('%Y%m%d-%H%M%S')}"
    doc: dict[str, Any] = run(measure(args, out))
    print_report(doc)
    print(f"results: {out / 'overhead.json'}  plot: {out / 'overhead.png'}")
    return 0


async def _level(
    urls: list[str],
    pid: int | None,
    profile: Profile,
    c: int,
    *,
    duration: float,
    stall_s: float,
) -> dict[str, Any]:
    from loadtest import procs
    from loadtest.arrivals import ClosedLoop, LoadShape
    from loadtest.client import ClientOptions, run_load
    from loadtest.stats import summarize
    from loadtest.workload import LengthDist, Workload

    workload = Workload(
        model="tiny", prompt=LengthDist.fixed(8), output=LengthDist.fixed(profile.max_tokens)
    )
    load = LoadShape(ClosedLoop(c), duration=duration, seed=c)
    options = ClientOptions(request_timeout=60.0, stall_timeout=10.0, grace=20.0)
    rss0 = procs.rss_bytes(pid) if pid else 0
    peak = [rss0]

    async def sample_rss() -> None:
        while pid:
            peak[0] = max(peak[0], procs.rss_bytes(pid))
            await asyncio.sleep(0.1)  # sleep-ok: RSS sampling period

    sampler = asyncio.create_task(sample_rss())
    cpu0 = procs.cpu_seconds(pid) if pid else 0.0
    result = await run_load(urls, workload, load, options)
    cpu = (procs.cpu_seconds(pid) - cpu0) if pid else None
    sampler.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sampler
    s = summarize(result.records)
    events = sum(len(r.token_times()) for r in result.records)
    # Requests that went silent past the client's stall timeout are errors ("stall"); these
    # are the ones that finished but with a gap above ``stall_s`` on the way.
    stalls = sum(1 for r in result.records if r.ok and any(g > stall_s for g in r.itls))
    wall = max(result.wall, 1e-9)
    return {
        "c": c,
        "ok": s.ok,
        "errors": s.errors,
        "unfinished": result.unfinished,
        "stalls": stalls,
        "clean": not s.errors and not result.unfinished and not stalls,
        "ttft_ms": s.ttft.to_json_ms(),
        "itl_ms": s.itl.to_json_ms(),
        "e2e_ms": s.e2e.to_json_ms(),
        "req_per_s": s.request_throughput,
        "events": events,
        "events_per_s": events / wall,
        "wall_s": wall,
        "gateway_cpu_s": cpu,
        "gateway_cpu_share": None if cpu is None else cpu / wall,
        "cpu_us_per_event": None if cpu is None or not events else cpu / events * 1e6,
        "rss_mb_before": rss0 / 2**20 if pid else None,
        "rss_mb_peak": peak[0] / 2**20 if pid else None,
        "rss_mb_per_1000_streams": (peak[0] - rss0) / 2**20 / c * 1000 if pid else None,
        "client_loop_lag_ms": result.loop_lag.to_json_ms(),
        "client_cpu_share": result.client_cpu_share,
    }


async def measure(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from loadtest import procs

    levels = [int(x) for x in str(args.levels).split(",") if x]
    profiles = [PROFILES[p] for p in str(args.profiles).split(",") if p]
    client_cpus = {args.client_cpu}
    own_affinity = os.sched_getaffinity(0)
    procs.pin(0, client_cpus)
    doc: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpus": os.cpu_count(),
        "gateway_cpu": args.gateway_cpu,
        "client_cpu": args.client_cpu,
        "policy": args.policy,
        "duration_s": args.duration,
        "profiles": {},
    }
    try:
        for profile in profiles:
            doc["profiles"][profile.name] = await _profile(args, profile, levels, out)
    finally:
        os.sched_setaffinity(0, own_affinity)
    doc["verdict"] = verdict(doc)
    save(doc, out)
    return doc


def save(doc: dict[str, Any], out: Path) -> None:
    from loadtest.report import clean

    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(clean(doc), indent=1) + "\n")
    plot_overhead(doc, out / "overhead.png")


async def _profile(
    args: argparse.Namespace, profile: Profile, levels: list[int], out: Path
) -> dict[str, Any]:
    import sys

    from loadtest import procs

    log_dir = out / "logs" / profile.name
    cmd = [sys.executable, "-m", "tools.fake_vllm", "--port", "0",
           "--ttft-ms", str(profile.ttft_ms), "--itl-ms", str(profile.itl_ms)]  # fmt: skip
    backends = [procs.spawn(f"backend{i}", cmd, log_dir, cpus={args.client_cpu}) for i in range(2)]
    result: dict[str, Any] = {"what": profile.what, "direct": [], "gateway": []}
    try:
        urls = list(await asyncio.gather(*(procs.wait_sim_url(b) for b in backends)))
        for target in ("direct", "gateway"):
            gw = None
            if target == "gateway":
                gw = procs.start_gateway(
                    urls,
                    args.policy,
                    log_dir,
                    env={"GATEWAY_LOG_LEVEL": "info"},
                    cpus={args.gateway_cpu},
                )
                await procs.wait_ok(gw, "/ready")
                result["gateway_cmd"] = gw.cmd
                result["gateway_idle_rss_mb"] = procs.rss_bytes(gw.pid) / 2**20
            try:
                target_urls = [gw.url] if gw else urls
                pid = gw.pid if gw else None
                # Warm-up: connections, code paths, the gateway's first scrapes.
                await _level(
                    target_urls, pid, profile, 16, duration=1.5, stall_s=args.stall_ms / 1e3
                )
                for c in levels:
                    row = await _level(
                        target_urls,
                        pid,
                        profile,
                        c,
                        duration=args.duration,
                        stall_s=args.stall_ms / 1e3,
                    )
                    result[target].append(row)
                    print(
                        f"  {profile.name:5} {target:7} c={c:<5} ok={row['ok']:<6} "
                        f"errors={sum(row['errors'].values())} ttft_p50="
                        f"{row['ttft_ms']['p50']} ms events/s={row['events_per_s']:,.0f}",
                        flush=True,
                    )
                    failed = row["ok"] == 0 or (
                        sum(row["errors"].values()) + row["unfinished"] > 0.01 * row["ok"]
                    )
                    if failed:
                        break  # like loadtest.peers: no higher level after a failed one
            finally:
                if gw is not None:
                    gw.stop()
    finally:
        procs.stop_all(backends)
    return result


def _by_c(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {int(r["c"]): r for r in rows}


def verdict(doc: dict[str, Any]) -> dict[str, Any]:
    """Added TTFT per level, highest clean concurrency, worst CPU/event, RSS per 1k streams."""
    out: dict[str, Any] = {}
    for name, prof in doc["profiles"].items():
        direct, gw = _by_c(prof["direct"]), _by_c(prof["gateway"])
        added = {}
        for c, g in gw.items():
            d = direct.get(c)
            if d and d["ttft_ms"]["p50"] is not None and g["ttft_ms"]["p50"] is not None:
                added[c] = {
                    "p50": g["ttft_ms"]["p50"] - d["ttft_ms"]["p50"],
                    "p99": g["ttft_ms"]["p99"] - d["ttft_ms"]["p99"],
                }
        clean = [c for c, g in sorted(gw.items()) if g["clean"]]
        out[name] = {
            "added_ttft_ms": added,
            "highest_clean_concurrency": max(clean) if clean else None,
            "cpu_us_per_event": {c: g["cpu_us_per_event"] for c, g in gw.items()},
            "rss_mb_per_1000_streams": {c: g["rss_mb_per_1000_streams"] for c, g in gw.items()},
        }
    return out


def print_report(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def f(x: Any, fmt: str = "{:,.1f}") -> str:
        return "-" if x is None else fmt.format(x)

    console = Console()
    if not console.is_terminal:
        console = Console(width=180)
    for name, prof in doc["profiles"].items():
        t = Table(title=f"overhead, profile {name}: {prof['what']}", title_justify="left")
        for col in ("target", "c", "ok", "err", "TTFT p50", "TTFT p99", "ΔTTFT p50",
                    "ΔTTFT p99", "ITL p99", "events/s", "gw CPU", "µs/event", "RSS MB",
                    "MB/1k streams"):  # fmt: skip
            t.add_column(col, justify="left" if col == "target" else "right")
        added = doc["verdict"][name]["added_ttft_ms"]
        for target in ("direct", "gateway"):
            for r in prof[target]:
                a = added.get(r["c"], {}) if target == "gateway" else {}
                t.add_row(
                    target,
                    str(r["c"]),
                    str(r["ok"]),
                    str(sum(r["errors"].values()) + r["unfinished"] + r["stalls"]),
                    f(r["ttft_ms"]["p50"], "{:.2f}"),
                    f(r["ttft_ms"]["p99"], "{:.2f}"),
                    f(a.get("p50"), "{:+.2f}"),
                    f(a.get("p99"), "{:+.2f}"),
                    f(r["itl_ms"]["p99"], "{:.2f}"),
                    f(r["events_per_s"], "{:,.0f}"),
                    f(r["gateway_cpu_share"], "{:.0%}"),
                    f(r["cpu_us_per_event"]),
                    f(r["rss_mb_peak"]),
                    f(r["rss_mb_per_1000_streams"]),
                )
        console.print(t)
        v = doc["verdict"][name]
        console.print(f"highest clean concurrency ({name}): {v['highest_clean_concurrency']}")


def plot_overhead(doc: dict[str, Any], path: Path) -> None:
    """TTFT p50/p99 and CPU per event against concurrency, direct and through the gateway."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(doc["profiles"])
    fig = Figure(figsize=(6 * max(len(names), 1), 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, max(len(names), 1), squeeze=False)
    for i, name in enumerate(names):
        prof = doc["profiles"][name]
        ax, cpu_ax = axes[0][i], axes[1][i]
        for target, style in (("direct", "o-"), ("gateway", "s-")):
            rows = [r for r in prof[target] if r["ttft_ms"]["p50"] is not None]
            cs = [r["c"] for r in rows]
            ax.plot(cs, [r["ttft_ms"]["p50"] for r in rows], style, label=f"{target} p50")
            ax.plot(
                cs, [r["ttft_ms"]["p99"] for r in rows], style, alpha=0.5, label=f"{target} p99"
            )
        rows = [r for r in prof["gateway"] if r["cpu_us_per_event"] is not None]
        cpu_ax.plot([r["c"] for r in rows], [r["cpu_us_per_event"] for r in rows], "s-")
        ax.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="TTFT (ms)")
        ax.set_title(f"{name}: {prof['what']}", fontsize="small")
        ax.legend(fontsize="small")
        cpu_ax.set(xscale="log", xlabel="concurrency", ylabel="gateway CPU µs per event")
        for a in (ax, cpu_ax):
            a.grid(alpha=0.3, which="both")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_arguments(p)
    return main_from_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
