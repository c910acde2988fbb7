"""The capacity manager over a compressed day on the simulator (issue 55's first "done when").

Two cases on the same scenario, one after the other (``--cases``, default both):

- ``managed``: the capacity manager on (``[capacity] enabled = true, every = 1``, ``RULE``);
- ``always-on``: the same without it: every engine awake all day.

Scenario: ``ENGINES`` simulators (``SIM_ARGS``: 8 sequences at a time, as the load-test
scenarios' backends, so one engine saturates at a sensible concurrency; dev mode; a wake takes
5 s) behind one gateway (least load). Demand: streaming chat requests of ``homogeneous``'s
lengths (prompt lognormal, median 98 tokens; output lognormal, median 48) sent open loop, a
Poisson process whose rate follows ``DAY``, a 12-minute day: 150 s at the trough (2 req/s), a
150-s ramp to the peak (16 req/s, 8:1; about 70 % of what the four engines serve), 120 s at the
peak, the ramp down, 150 s at the trough. Before it, ``--warmup`` seconds at the trough rate,
not counted: the day starts as it would after the night before (the managed fleet down to what
the trough needs).

Every second the run samples the arrival rate and the requests in flight (the client's), each
simulator's ``GET /is_sleeping`` (the truth: awake is ``false``) and ``/metrics`` (running,
waiting, a sleep or wake under way, GPU memory), and the gateway's ``/metrics``
(``llm_gateway_engine_state``, held requests, the engines the manager wants). Every request's
TTFT is the client's; a failure is any answer other than 200 or a stream that breaks or ends
without ``[DONE]``. Figures per case: awake engine-seconds (from ``/is_sleeping``, and as a
share of always-on, ``ENGINES`` x the day), TTFT p50 and p99 per ``--window`` (30 s) by send
time, the failed requests, the holds (``llm_gateway_capacity_holds_total``) and the manager's
decisions (``llm_gateway_capacity_decisions_total``).

Why these settings (``--calibrate`` re-measures the engine's side, ``calibration.json``):

- ``SLO`` = 1 s (TTFT p99 of every window). One engine in a closed loop of ``c`` requests (the
  manager's unit: requests running or waiting on an engine) has a TTFT p99 of about 0.12 s up
  to 8 (nothing waits), 0.6 s at 9, 0.85 s at 10, 1.1 s at 11, 1.4 s at 12: each request
  beyond 8 waits for a slot. The always-on fleet at the peak (about 23 requests on 32 slots)
  answers with a p99 of 0.12 to 0.25 s a window. 1 s allows a short wait for a slot, never a
  request queued behind a whole answer (1.4 s on average) nor one held for a wake (5 s).
- ``per_engine`` = 10: the most requests at which one engine's closed-loop TTFT p99 stays
  within the SLO.
- ``headroom`` = 0.5: demand is a Poisson process, not a level. With 0.5 the manager keeps
  ``k`` engines while the mean it reads stays under ``10 k / 1.5``; the requests in flight
  then go past the ``10 k`` the engines serve within the SLO about 1 % of the time at 3
  engines (mean 20, limit 30), 3 % at 2, 8 % at 1 (where the trough's 3 requests sit far
  below it). The trend (``wake_time`` ahead) covers the ramp's growth during a wake.
- ``idle_before_sleep`` = 20 s: four wakes' worth; demand must stay low that long before an
  engine sleeps, so a dip of a few seconds does not put one to sleep that is wanted back at
  once. ``sleep_mode = "wait"``: an engine put to sleep finishes what it runs.

Written to ``--out``: ``<case>.json`` (the settings, every sample, every request, the windows,
the figures, the gateway's ``capacity_*`` and ``backend_sleep`` log lines), ``day.png`` (per
case side by side: demand, engines awake, TTFT p99 per window against the SLO) and, with
``--calibrate``, ``calibration.json``; a summary line per case is printed.

Run: ``python -m loadtest.bench.capacity --calibrate --out docs/bench/capacity-<date>`` (about
33 min on 2 cores; docs/capacity.md, "The compressed day", has a run's figures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp

from loadtest import procs
from loadtest.arrivals import ClosedLoop, LoadShape, OpenLoop
from loadtest.bench.capacity_report import (
    REQUEST_COLUMNS,
    Sent,
    dump,
    figures,
    plot,
    rows,
    summary,
)
from loadtest.bench.page import Families, families
from loadtest.bench.page import total as _total
from loadtest.client import error_kind, run_load
from loadtest.day import compressed_day
from loadtest.stats import percentile, timings_from_timer
from loadtest.stream import StreamTimer
from loadtest.workload import LengthDist, RequestSpec, Workload

MODEL: Final = "sim-model"
ENGINES: Final = 4
SIM_ARGS: Final = ["--model", MODEL, "--max-num-seqs", "8", "--dev-mode", "--wake-time", "5"]
WORKLOAD: Final = Workload(
    model=MODEL,
    prompt=LengthDist.lognormal(median=98, sigma=1.0, low=4, high=1024),
    output=LengthDist.lognormal(median=48, sigma=0.6, low=4, high=256),
    seed=55,
)
DAY: Final = compressed_day(2.0, 16.0, trough_s=150, ramp_s=150, peak_s=120)
SLO: Final = 1.0  # TTFT p99 of every window, seconds
RULE: Final[dict[str, Any]] = {
    "min_awake": 1,
    "max_awake": ENGINES,
    "headroom": 0.5,
    "per_engine": 10.0,
    "sleep_level": 1,
    "sleep_mode": "wait",
    "idle_before_sleep": 20.0,
    "drain_timeout": 30.0,
    "wake_time": 5.0,
    "wake_timeout": 30.0,
    "ttft_slo": SLO,
    "kv_high": 0.9,
}
CASES: Final = ("managed", "always-on")
SAMPLE_EVERY: Final = 1.0
CALIBRATE_LEVELS: Final = (4, 6, 8, 9, 10, 11, 12)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def gateway_config(sims: dict[str, str], port: int, *, managed: bool) -> str:
    """The gateway's TOML: the engines, and capacity on (``managed``) or off."""
    backends = ", ".join(f'{{ url = "{url}", name = "{n}" }}' for n, url in sims.items())
    lines = [
        f"port = {port}",
        f"backends = [{backends}]",
        'log_level = "info"',
        'log_format = "json"',
        "[capacity]",
        f"enabled = {_toml(managed)}",
        "every = 1",
        f'[capacity.models."{MODEL}"]',
        *(f"{k} = {_toml(v)}" for k, v in RULE.items()),
    ]
    return "\n".join(lines) + "\n"


@dataclass(slots=True)
class Run:
    t0: float  # perf_counter at the day's start
    requests: list[Sent] = field(default_factory=list)
    in_flight: int = 0
    sent_times: list[float] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)  # the client loop's, every 10 ms


async def _one(s: aiohttp.ClientSession, url: str, spec: RequestSpec, run: Run) -> None:
    body = json.dumps(spec.body, separators=(",", ":")).encode()
    sent = time.perf_counter()
    record = Sent(at=sent - run.t0, prompt_tokens=spec.prompt_tokens)
    run.in_flight += 1
    timer = StreamTimer()
    try:
        async with s.post(url + "/v1/chat/completions", data=body) as r:
            record.status = r.status
            if r.status != 200:
                await r.read()
                record.error = f"http_{r.status}"
            else:
                while chunk := await r.content.readany():
                    timer.feed(time.perf_counter(), chunk)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        record.error = error_kind(exc)
    finally:
        run.in_flight -= 1
    record.e2e = time.perf_counter() - sent
    if record.error is None:
        t = timings_from_timer(sent, timer)
        record.ttft = t.ttft
        if t.error is not None:
            record.error = "stream_error"
        elif not t.done:
            record.error = "incomplete"
        elif t.content_events == 0:
            record.error = "no_content"
    run.requests.append(record)


async def _drive(url: str, schedule: list[float], run: Run) -> None:
    """Send one request at each time of ``schedule`` (seconds from the day's start), then wait
    for the last answers."""
    specs = WORKLOAD.requests()
    headers = {"Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=120, sock_read=30)
    connector = aiohttp.TCPConnector(limit=0)
    tasks: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as s:
        for at in schedule:
            delay = run.t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # sleep-ok: the open-loop arrival schedule
            run.sent_times.append(time.perf_counter() - run.t0)
            task = asyncio.create_task(_one(s, url, next(specs), run))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)


WANTED: Final = (
    "vllm:num_requests_",
    "vllm:sleep_mode_operations_in_flight",
    "sim:gpu_memory_used_bytes",
    "sim:clock_lag_seconds",
    "llm_gateway_engine_state",
    "llm_gateway_capacity_",
)


def _families(text: str | None) -> Families:
    return families(text, WANTED)


async def _sleeping(s: aiohttp.ClientSession, url: str) -> bool | None:
    with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
        async with s.get(url + "/is_sleeping") as r:
            doc = await r.json()
            return bool(doc["is_sleeping"])
    return None


async def _sample(s: aiohttp.ClientSession, sims: dict[str, str], gw: str, run: Run) -> None:
    t = time.perf_counter() - run.t0
    names = list(sims)
    asleep = asyncio.gather(*(_sleeping(s, sims[n]) for n in names))
    pages = asyncio.gather(
        *(procs.fetch_text(s, sims[n] + "/metrics") for n in names),
        procs.fetch_text(s, gw + "/metrics"),
    )
    flags, texts = await asyncio.gather(asleep, pages)
    # What did not answer within the timeout (a stalled machine) keeps its last value, so the
    # engine-seconds count neither a gap as asleep nor as awake that had not changed.
    last = run.samples[-1] if run.samples else None
    sleeping = dict(zip(names, flags, strict=True))
    unanswered = [n for n, v in sleeping.items() if v is None]
    if last is not None:
        for n in unanswered:
            sleeping[n] = last["sleeping"].get(n)
    metrics = [_families(text) for text in texts[:-1]]
    g = _families(texts[-1])
    states = {
        state: int(_total(g, "llm_gateway_engine_state", state=state))
        for state in ("awake", "going_to_sleep", "asleep", "waking")
    }
    if not g:
        unanswered.append("gateway")
        if last is not None:
            states = last["gateway"]

    def gone(key: str) -> Any:
        return None if last is None else last[key]

    run.samples.append(
        {
            "t": round(t, 3),
            "unanswered": unanswered,
            "rate": round(DAY.rate(max(t, 0.0)) if t >= 0 else DAY.trough, 3),
            "sent": sum(1 for x in run.sent_times[-64:] if t - 1.0 < x <= t),
            "in_flight": run.in_flight,
            "sleeping": sleeping,
            "awake": sum(1 for v in sleeping.values() if v is False),
            "moving": sum(
                1 for m in metrics if _total(m, "vllm:sleep_mode_operations_in_flight") > 0
            ),
            "running": sum(_total(m, "vllm:num_requests_running") for m in metrics),
            "waiting": sum(_total(m, "vllm:num_requests_waiting") for m in metrics),
            "loadavg_1m": round(os.getloadavg()[0], 2),  # the machine's, other work included
            "sim_clock_lag_s": max(_total(m, "sim:clock_lag_seconds") for m in metrics),
            "gpu_gib": round(
                sum(_total(m, "sim:gpu_memory_used_bytes") for m in metrics) / 2**30, 2
            ),
            "gateway": states,
            "held": _total(g, "llm_gateway_capacity_held_requests"),
            "needed": _total(g, "llm_gateway_capacity_needed_engines") if g else gone("needed"),
            "desired": _total(g, "llm_gateway_capacity_desired_engines") if g else gone("desired"),
        }
    )


async def _sampler(sims: dict[str, str], gw: str, run: Run, until: float) -> None:
    timeout = aiohttp.ClientTimeout(total=0.8)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        k = math.ceil((time.perf_counter() - run.t0) / SAMPLE_EVERY)
        while k * SAMPLE_EVERY <= until:
            delay = run.t0 + k * SAMPLE_EVERY - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # sleep-ok: the sampling period
            await _sample(s, sims, gw, run)
            k += 1


def _commit() -> dict[str, Any]:
    """The checkout measured: its commit and the files changed since in the code that runs."""

    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], check=False, capture_output=True, text=True)
        return done.stdout.rstrip()

    changed = git("status", "--porcelain", "--", "gateway", "backends", "tools/sim")
    return {"head": git("rev-parse", "--short", "HEAD"), "changed": changed.splitlines()}


async def _probe_lag(lags: list[float], interval: float = 0.01) -> None:
    while True:
        t = time.perf_counter()
        await asyncio.sleep(interval)  # sleep-ok: the probe measures how late this wakes
        lags.append(max(time.perf_counter() - t - interval, 0.0))


def _log_events(path: Path) -> list[dict[str, Any]]:
    events = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            event = str(doc.get("event", "")) if isinstance(doc, dict) else ""
            if event.startswith("capacity_") or event.startswith("backend_sleep"):
                events.append(doc)
    return events


async def run_case(name: str, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    started: list[procs.Proc] = []
    try:
        sims: dict[str, str] = {}
        for i in range(ENGINES):
            p = procs.start_sim(f"{name}-e{i}", SIM_ARGS, logs)
            started.append(p)
            sims[f"e{i}"] = await procs.wait_sim_url(p)
        port = procs.free_port()
        config = logs / f"{name}.toml"
        config.write_text(gateway_config(sims, port, managed=name == "managed"))
        gw = procs.start_gateway_with_config(
            config, f"http://127.0.0.1:{port}", logs, name=f"{name}-gateway"
        )
        started.append(gw)
        await procs.wait_ok(gw, "/ready", within=60)
        await asyncio.sleep(2)  # sleep-ok: every engine scraped and probed once
        warmup = OpenLoop(DAY.trough).times(args.seed, until=args.warmup)
        schedule = [t - args.warmup for t in warmup] + DAY.arrivals(args.seed)
        run = Run(t0=time.perf_counter() + args.warmup)
        t0_unix = time.time() + args.warmup  # the day's start, to place the log lines
        sampler = asyncio.create_task(_sampler(sims, gw.url, run, DAY.duration + 5))
        lag = asyncio.create_task(_probe_lag(run.lags))
        try:
            await _drive(gw.url, schedule, run)
            await sampler
        finally:
            lag.cancel()
            sampler.cancel()
        async with aiohttp.ClientSession() as s:
            final = _families(await procs.fetch_text(s, gw.url + "/metrics"))
    finally:
        procs.stop_all(started)
    return {
        "case": name,
        "commit": _commit(),
        "engines": ENGINES,
        "sim_args": SIM_ARGS,
        "workload": {"prompt": asdict(WORKLOAD.prompt), "output": asdict(WORKLOAD.output)},
        "day": [list(p) for p in DAY.points],
        "warmup_s": args.warmup,
        "t0_unix": round(t0_unix, 3),
        "seed": args.seed,
        "slo_s": SLO,
        "rule": RULE if name == "managed" else None,
        "samples": run.samples,
        "requests": {"columns": list(REQUEST_COLUMNS), "rows": rows(run.requests)},
        "holds": {ls["outcome"]: v for ls, v in final.get("llm_gateway_capacity_holds_total", [])},
        "decisions": {
            f"{ls['action']}:{ls['outcome']}": v
            for ls, v in final.get("llm_gateway_capacity_decisions_total", [])
        },
        "events": _log_events(gw.log_path),
        "figures": figures(
            run.samples,
            run.requests,
            width=args.window,
            end=DAY.duration,
            engines=ENGINES,
            slo=SLO,
        ),
        "client_loop_lag_ms": {
            "p99": round(percentile(sorted(run.lags), 99) * 1000, 1),
            "max": round(max(run.lags, default=0.0) * 1000, 1),
        },
    }


async def calibrate(args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    """One engine, closed loops of ``CALIBRATE_LEVELS`` requests at a time (the manager's unit:
    requests running or waiting on an engine): TTFT p50 and p99 at each."""
    p = procs.start_sim("calibrate", SIM_ARGS, logs)
    levels: list[dict[str, Any]] = []
    try:
        url = await procs.wait_sim_url(p)
        for c in CALIBRATE_LEVELS:
            load = LoadShape(ClosedLoop(c), duration=args.calibrate_s, warmup=3, seed=args.seed)
            result = await run_load(url, WORKLOAD, load)
            ok = [r for r in result.records if r.ok and not r.warmup and r.ttft is not None]
            ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
            e2es = [r.e2e for r in ok if r.e2e is not None]
            levels.append(
                {
                    "concurrency": c,
                    "requests": len(ok),
                    "ttft_p50": percentile(ttfts, 50),
                    "ttft_p99": percentile(ttfts, 99),
                    "e2e_mean": sum(e2es) / len(e2es) if e2es else math.nan,
                }
            )
            row = levels[-1]
            print(f"concurrency {c}: TTFT p50 {row['ttft_p50'] * 1000:.0f} ms, p99 "
                  f"{row['ttft_p99'] * 1000:.0f} ms, E2E mean {row['e2e_mean']:.2f} s "
                  f"({row['requests']} requests)", flush=True)  # fmt: skip
    finally:
        procs.stop_all([p])
    return levels


async def main_async(args: argparse.Namespace, out: Path) -> None:
    with tempfile.TemporaryDirectory() as made:
        tmp = args.logs or made
        if args.calibrate:
            levels = await calibrate(args, Path(tmp) / "calibrate")
            doc = {"sim_args": SIM_ARGS, "duration_s": args.calibrate_s, "levels": levels}
            (out / "calibration.json").write_text(json.dumps(doc, indent=1) + "\n")
        results = []
        for name in [c for c in args.cases.split(",") if c]:
            if name not in CASES:
                raise SystemExit(f"unknown case {name!r} (cases: {', '.join(CASES)})")
            started = time.monotonic()
            result = await run_case(name, args, Path(tmp) / name)
            result["wall_s"] = round(time.monotonic() - started, 1)
            (out / f"{name}.json").write_text(dump(result))
            print(summary(result), flush=True)
            results.append(result)
        if results:
            plot(results, out / "day.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds at the trough first")
    parser.add_argument("--window", type=float, default=30.0, help="seconds a TTFT window")
    parser.add_argument("--seed", type=int, default=55, help="seed of the arrival times")
    parser.add_argument("--calibrate", action="store_true", help="measure one engine first")
    parser.add_argument("--calibrate-s", type=float, default=30.0, help="seconds a level")
    parser.add_argument("--logs", help="keep the processes' logs here (default: dropped)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    asyncio.run(main_async(args, out))


if __name__ == "__main__":
    main()
