"""Twice the fleet's capacity for a minute, shed by priority (issue 56's first two "done when").

The fleet: ``ENGINES`` simulators (``SIM_ARGS``: 8 sequences at a time, as the load-test
scenarios' backends; vLLM's ``--scheduling-policy priority``), marked ``scheduling =
"priority"`` behind one gateway (least load; the admission queue on, an engine saturated at
``MAX_IN_FLIGHT`` requests, two more than it runs, so each has a short queue of its own that
it orders by priority). Three API keys, one per tier (``TIERS``): ``interactive`` (priority
10, may wait 1 s in the queue), ``standard`` (0, 10 s), ``batch`` (-10, 20 s); the queue's own
``max_wait`` is its default, 30 s. The retry budget is the default one (0.2 extra attempts a
request plus 5 a second, over 10 s).

Demand: streaming chat requests of ``homogeneous``'s lengths (prompt lognormal, median 98
tokens; output lognormal, median 48), a third from each key, open loop (Poisson): ``BEFORE_S``
at half the fleet's capacity, then ``OVERLOAD_S`` at twice it, then nothing new. Clients honour
``Retry-After``: a 429 or 503 that carries it is sent again that many seconds later (until
``CLIENT_DEADLINE`` after the first send: then the client gives up); anything else is an error,
and a stream that stops after some content without ``[DONE]`` (or with an error event) is a
stream broken mid-way.

Capacity (``--capacity`` to give it): the fleet under the ``no-priorities`` configuration at
rising rates (``LEVELS``, ``LEVEL_S`` each, the first ``LEVEL_WARMUP_S`` not counted); the
highest rate whose TTFT p99 is within ``KNEE`` times the idle one (the lowest rate's).

Cases (``--cases``, default every one), each on fresh processes:

- ``priorities``: the tiers above; the engines get each request's priority;
- ``no-priorities``: the same load and keys, every tier at priority 0 with the queue's
  ``max_wait`` (what the gateway did before issue 56);
- ``backend-killed``: ``priorities``, one simulator SIGKILLed ``KILL_AT`` s into the overload.

Every second the run samples the gateway's ``/metrics`` (admission queue, its outcomes, the
retry budget, stream continuations) and each simulator's (requests received: succeeded,
aborted, running, waiting). Written to ``--out``: ``capacity.json`` (each level), ``<case>.json``
(settings, figures per class, windows, samples, the budget's windows, the gateway's log
summary, every request with its attempts), ``overload.png`` (per class TTFT p99 and refusals
per window, the cases side by side) and ``budget.png`` (``backend-killed``: extra attempts
against the budget, the load offered against what reached the engines). A summary is printed.

Run: ``python -m loadtest.bench.overload --out docs/bench/overload-<date>`` (about 15 min).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp

from loadtest import procs
from loadtest.arrivals import OpenLoop
from loadtest.bench.overload_watch import admitted, gateway_log, sampler
from loadtest.client import error_kind
from loadtest.overload import (
    Attempt,
    Request,
    budget_table,
    budget_windows,
    capacity,
    class_figures,
    class_table,
    classify,
    timeline,
)
from loadtest.stats import percentile, timings_from_timer
from loadtest.stream import StreamTimer
from loadtest.workload import LengthDist, RequestSpec, Workload

MODEL: Final = "sim-model"
ENGINES: Final = 3
SIM_ARGS: Final = ["--model", MODEL, "--max-num-seqs", "8", "--scheduling-policy", "priority"]
MAX_IN_FLIGHT: Final = 10
WORKLOAD: Final = Workload(
    model=MODEL,
    prompt=LengthDist.lognormal(median=98, sigma=1.0, low=4, high=1024),
    output=LengthDist.lognormal(median=48, sigma=0.6, low=4, high=256),
    seed=56,
)


@dataclass(frozen=True, slots=True)
class Tier:
    name: str
    priority: int
    max_wait: float

    @property
    def key(self) -> str:
        return f"sk-bench-{self.name}"


TIERS: Final = (Tier("interactive", 10, 1.0), Tier("standard", 0, 10.0), Tier("batch", -10, 20.0))
CLASSES: Final = tuple(t.name for t in TIERS)
SLO_TTFT_P99: Final = 2.0  # interactive: its 1 s in the queue, then a slot in the engine
BUDGET: Final = {"ratio": 0.2, "min_per_second": 5.0, "window": 10.0}  # [retry]'s defaults
BEFORE_S: Final = 10.0
OVERLOAD_S: Final = 60.0
FACTOR: Final = 2.0
KILL_AT: Final = 20.0
CLIENT_DEADLINE: Final = 600.0
LEVELS: Final = (4.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 22.0)
LEVEL_S: Final = 35.0
LEVEL_WARMUP_S: Final = 5.0
KNEE: Final = 2.0
WINDOW_S: Final = 5.0
CASES: Final = ("priorities", "no-priorities", "backend-killed")


def gateway_config(sims: dict[str, str], port: int, *, priorities: bool) -> str:
    """The gateway's TOML: the engines (marked as scheduling by priority), the admission
    queue, one key per tier; the tiers' priorities and waits only with ``priorities``."""
    lines = [f"port = {port}", 'log_level = "info"', 'log_format = "json"']
    for name, url in sims.items():
        lines += ["[[backends]]", f'url = "{url}"', f'name = "{name}"', 'scheduling = "priority"']
    lines += ["[limits]", "auth = true", "[limits.admission]", "enabled = true",
              f"max_in_flight = {MAX_IN_FLIGHT}"]  # fmt: skip
    for t in TIERS:
        lines.append(f"[limits.tiers.{t.name}]")
        if priorities:
            lines += [f"priority = {t.priority}", f"max_priority = {max(t.priority, 0)}",
                      f"max_wait = {t.max_wait}"]  # fmt: skip
    for t in TIERS:
        digest = hashlib.sha256(t.key.encode()).hexdigest()
        lines += ["[[limits.keys]]", f'name = "{t.name}"', f'hash = "sha256:{digest}"',
                  f'tier = "{t.name}"']  # fmt: skip
    return "\n".join(lines) + "\n"


@dataclass
class Fleet:
    sims: dict[str, procs.Proc]
    gateway: procs.Proc

    @property
    def all(self) -> list[procs.Proc]:
        return [*self.sims.values(), self.gateway]


async def start_fleet(name: str, logs: Path, *, priorities: bool) -> Fleet:
    started: list[procs.Proc] = []
    try:
        sims: dict[str, procs.Proc] = {}
        for i in range(ENGINES):
            sim = procs.start_sim(f"{name}-e{i}", SIM_ARGS, logs)
            started.append(sim)
            sims[f"e{i}"] = sim
            await procs.wait_sim_url(sim)
        port = procs.free_port()
        config = logs / f"{name}.toml"
        urls = {n: p.url for n, p in sims.items()}
        config.write_text(gateway_config(urls, port, priorities=priorities))
        gateway = procs.start_gateway_with_config(
            config, f"http://127.0.0.1:{port}", logs, name=f"{name}-gateway"
        )
        started.append(gateway)
        await procs.wait_ok(gateway, "/ready", within=60)
    except BaseException:
        procs.stop_all(started)
        raise
    return Fleet(sims, gateway)


@dataclass
class Load:
    """One run's clients: every request sent, and the in-flight count."""

    url: str
    t0: float  # perf_counter of the overload's start
    requests: list[Request]
    in_flight: int = 0


async def _attempt(s: aiohttp.ClientSession, load: Load, spec: RequestSpec, cls: str) -> Attempt:
    body = json.dumps(spec.body, separators=(",", ":")).encode()
    headers = {"Authorization": f"Bearer sk-bench-{cls}", "Content-Type": "application/json"}
    sent = time.perf_counter()
    a = Attempt(sent=sent - load.t0)
    timer = StreamTimer()
    failed = False
    load.in_flight += 1
    try:
        async with s.post(load.url + spec.path, data=body, headers=headers) as r:
            a.status = r.status
            if r.status != 200:
                doc = await r.json(content_type=None)
                err = doc.get("error", {}) if isinstance(doc, dict) else {}
                a.code = err.get("code") if isinstance(err, dict) else None
                with contextlib.suppress(TypeError, ValueError):
                    a.retry_after = float(r.headers.get("Retry-After"))  # type: ignore[arg-type]
            else:
                while chunk := await r.content.readany():
                    timer.feed(time.perf_counter(), chunk)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        failed, a.error = True, error_kind(exc)
    finally:
        load.in_flight -= 1
    a.ended = time.perf_counter() - load.t0
    t = timings_from_timer(sent, timer)
    a.ttft, a.content = t.ttft, t.content_events
    a.outcome = classify(
        a.status,
        retry_after=a.retry_after,
        done=t.done,
        stream_error=t.error is not None,
        content=a.content,
        failed=failed,
    )
    if a.outcome in ("broken", "error") and a.error is None:
        a.error = t.error or ("no_done" if a.status == 200 else f"http_{a.status}")
    return a


async def _request(s: aiohttp.ClientSession, load: Load, spec: RequestSpec, cls: str) -> None:
    """One user's request: sent again after each refusal's Retry-After, until the deadline."""
    req = Request(cls, first_sent=time.perf_counter() - load.t0)
    load.requests.append(req)
    while True:
        a = await _attempt(s, load, spec, cls)
        req.attempts.append(a)
        if a.outcome != "refused" or a.retry_after is None:
            return
        if a.ended is not None and a.ended + a.retry_after > req.first_sent + CLIENT_DEADLINE:
            req.gave_up = True
            return
        await asyncio.sleep(a.retry_after)  # sleep-ok: the client honours Retry-After


def schedule(cap: float, seed: int) -> list[tuple[float, str]]:
    """Send times (from the overload's start; the half-capacity lead-in is negative) and the
    class of each."""
    before = OpenLoop(cap / 2).times(seed, until=BEFORE_S)
    during = OpenLoop(cap * FACTOR).times(seed + 1, until=OVERLOAD_S)
    rng = random.Random(f"classes-{seed}")
    return [(t, rng.choice(CLASSES)) for t in [b - BEFORE_S for b in before] + during]


async def drive(load: Load, plan: list[tuple[float, str]], *, drain: float) -> int:
    """Send the plan's requests, then wait for every one (at most ``drain`` s after the last
    send); the number still unfinished then (cancelled)."""
    specs = WORKLOAD.requests()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    tasks: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        for at, cls in plan:
            delay = load.t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # sleep-ok: the open-loop arrival schedule
            task = asyncio.create_task(_request(s, load, next(specs), cls))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if not tasks:
            return 0
        _, pending = await asyncio.wait(set(tasks), timeout=drain)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return len(pending)


async def run_case(name: str, cap: float, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    fleet = await start_fleet(name, logs, priorities=name != "no-priorities")
    samples: list[dict[str, Any]] = []
    killed_at: float | None = None
    plan = schedule(cap, args.seed)
    try:
        load = Load(fleet.gateway.url, time.perf_counter() + 1.0 + BEFORE_S, [])
        urls = {n: p.url for n, p in fleet.sims.items()}
        sampling = asyncio.create_task(
            sampler(urls, fleet.gateway.url, load.t0, lambda: load.in_flight, samples)
        )

        async def kill() -> None:
            nonlocal killed_at
            await asyncio.sleep(load.t0 + KILL_AT - time.perf_counter())  # sleep-ok: on time
            fleet.sims[f"e{ENGINES - 1}"].kill()
            killed_at = time.perf_counter() - load.t0

        killing = asyncio.create_task(kill()) if name == "backend-killed" else None
        unfinished = await drive(load, plan, drain=args.drain)
        await asyncio.sleep(1.5)  # sleep-ok: one last sample after the last answer
        sampling.cancel()
        if killing is not None:
            await killing
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
    finally:
        procs.stop_all(fleet.all)
    log = gateway_log(fleet.gateway.log_path)
    return result(name, cap, load, samples, killed_at=killed_at, unfinished=unfinished, log=log)


def result(
    name: str,
    cap: float,
    load: Load,
    samples: list[dict[str, Any]],
    *,
    killed_at: float | None,
    unfinished: int,
    log: dict[str, Any],
) -> dict[str, Any]:
    reqs = sorted(load.requests, key=lambda r: r.first_sent)
    end = max((a.sent for r in reqs for a in r.attempts), default=OVERLOAD_S)
    counts = [
        (s["t"], sum(e["received"] for e in s["engines"].values()), admitted(s)) for s in samples
    ]
    windows = budget_windows(
        counts,
        ratio=BUDGET["ratio"],
        min_per_second=BUDGET["min_per_second"],
        window=BUDGET["window"],
    )
    last = samples[-1] if samples else {}
    return {
        "case": name,
        "capacity_rps": cap,
        "rate_rps": cap * FACTOR,
        "settings": {
            "engines": ENGINES,
            "sim_args": SIM_ARGS,
            "max_in_flight": MAX_IN_FLIGHT,
            "tiers": [asdict(t) for t in TIERS],
            "priorities": name != "no-priorities",
            "slo_ttft_p99_s": SLO_TTFT_P99,
            "budget": BUDGET,
            "before_s": BEFORE_S,
            "overload_s": OVERLOAD_S,
            "factor": FACTOR,
            "client_deadline_s": CLIENT_DEADLINE,
            "workload": {
                "prompt": asdict(WORKLOAD.prompt),
                "output": asdict(WORKLOAD.output),
                "seed": WORKLOAD.seed,
            },
        },
        "killed_at": killed_at,
        "unfinished": unfinished,
        "figures": class_figures(reqs, CLASSES, since=0.0),
        "figures_before": class_figures(
            [r for r in reqs if r.first_sent < 0], CLASSES, since=-BEFORE_S
        ),
        "timeline": timeline(reqs, CLASSES, width=WINDOW_S, start=-BEFORE_S, end=end + 1),
        "gateway": log,
        "final": {k: last.get(k) for k in ("admission", "budget", "continuations")},
        "budget_use_max": max((s["budget_use"] for s in samples), default=None),
        "budget_windows": windows,
        "samples": samples,
        "requests": [_compact(r) for r in reqs],
    }


def _compact(r: Request) -> list[Any]:
    """A request as the JSON keeps it: class, first send, gave up, then each attempt's send,
    status, code, Retry-After, TTFT, end, content events, outcome, error."""

    def r3(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    attempts = [
        [
            r3(a.sent),
            a.status,
            a.code,
            a.retry_after,
            r3(a.ttft),
            r3(a.ended),
            a.content,
            a.outcome,
            a.error,
        ]
        for a in r.attempts
    ]
    return [r.cls, r3(r.first_sent), r.gave_up, attempts]


async def measure_capacity(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """TTFT p99 at each of ``LEVELS`` (open loop, all classes, no priorities) until the
    fleet is past its knee; the capacity."""
    fleet = await start_fleet("capacity", logs, priorities=False)
    levels: list[dict[str, Any]] = []
    try:
        for i, rate in enumerate(LEVELS):
            load = Load(fleet.gateway.url, time.perf_counter() + 0.5, [])
            rng = random.Random(f"capacity-{i}")
            plan = [(t, rng.choice(CLASSES)) for t in OpenLoop(rate).times(i, until=LEVEL_S)]
            await drive(load, plan, drain=120.0)
            counted = [r for r in load.requests if r.first_sent >= LEVEL_WARMUP_S]
            ttft = sorted(a.ttft for r in counted if r.ok and (a := r.last) and a.ttft)
            levels.append(
                {
                    "rate": rate,
                    "requests": len(counted),
                    "ok": sum(1 for r in counted if r.ok),
                    "ttft_p50_ms": round(percentile(ttft, 50) * 1e3, 1),
                    "ttft_p99_ms": round(percentile(ttft, 99) * 1e3, 1),
                    "loadavg_1m": round(os.getloadavg()[0], 2),
                }
            )
            print(f"capacity: {rate:g} req/s: TTFT p50 {levels[-1]['ttft_p50_ms']} ms, "
                  f"p99 {levels[-1]['ttft_p99_ms']} ms", flush=True)  # fmt: skip
            idle = levels[0]["ttft_p99_ms"]
            if len(levels) > 2 and all(lv["ttft_p99_ms"] > KNEE * idle for lv in levels[-2:]):
                break  # past the knee: two levels in a row over it
    finally:
        procs.stop_all(fleet.all)
    cap = capacity([(lv["rate"], lv["ttft_p99_ms"] / 1e3) for lv in levels], KNEE)
    return {"levels": levels, "knee_factor": KNEE, "capacity_rps": cap}


def summary(res: dict[str, Any]) -> str:
    killed = res["killed_at"]
    head = f"{res['case']}: {res['rate_rps']:g} req/s for {OVERLOAD_S:g} s"
    lines = [head + (f", e{ENGINES - 1} killed at {killed:.1f} s" if killed else "")]
    for cls, f in res["figures"].items():
        lines.append(
            f"  {cls:<12} {f['requests']:>5} requests, {f['ok']} ok, {f['errors']} errors, "
            f"{f['broken_mid_stream']} broken mid-stream, {f['gave_up']} gave up; "
            f"refused {f['refused']} ({f['refused_by_code']}), Retry-After p50 "
            f"{f['retry_after_s']['p50']} max {f['retry_after_s']['max']}; TTFT p50/p99 "
            f"{f['ttft_ms']['p50']}/{f['ttft_ms']['p99']} ms, as seen by the user "
            f"{f['user_ttft_ms']['p50']}/{f['user_ttft_ms']['p99']} ms"
        )
    b = res["final"]["budget"] or {}
    lines.append(f"  budget: {b}, use max {res['budget_use_max']}; "
                 f"sent to engines {res['gateway']['sent_to_engines']}")  # fmt: skip
    return "\n".join(lines)


async def main_async(args: argparse.Namespace, out: Path, logs: Path) -> None:
    if args.capacity is None:
        cal = await measure_capacity(args, logs / "capacity")
        (out / "capacity.json").write_text(json.dumps(cal, indent=1) + "\n")
        cap = float(cal["capacity_rps"])
    else:
        cap = args.capacity
    print(f"capacity {cap:g} req/s; overload {cap * FACTOR:g} req/s", flush=True)
    results: list[dict[str, Any]] = []
    for name in args.cases.split(","):
        res = await run_case(name, cap, args, logs / name)
        (out / f"{name}.json").write_text(json.dumps(res, separators=(",", ":")) + "\n")
        print(summary(res), flush=True)
        results.append(res)
    print(class_table(results), budget_table(results), sep="\n\n", flush=True)
    from loadtest.bench.overload_plot import plot_all

    plot_all(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--capacity", type=float, help="req/s; measured when not given")
    parser.add_argument("--seed", type=int, default=56)
    parser.add_argument(
        "--drain",
        type=float,
        default=CLIENT_DEADLINE + 60,
        help="seconds after the last send to wait for the last answers",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--logs", help="keep the processes' logs here (default: a temp dir)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main_async(args, out, Path(args.logs or tmp)))


if __name__ == "__main__":
    main()
