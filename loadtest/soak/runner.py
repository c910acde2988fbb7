"""``llm-gateway loadtest soak``: the production configuration under load and faults, judged.

One run starts its own Redis, an OTLP sink, three simulators (gpu-a, gpu-b, gpu-canary) and
two gateway replicas running ``deploy/gateway.production.toml`` rewritten for the run
(``loadtest.soak.fleet``); sends a mixed, seeded load to both replicas (``loadtest.soak.mix``,
``loadtest.soak.client``); fires a schedule of faults (``loadtest.soak.faults``,
``loadtest.soak.chaos``); polls ``/ready`` and ``/metrics`` and samples memory throughout;
waits for the fleet to settle; and judges the invariants (``loadtest.soak.invariants``).
It writes ``result.json``, ``report.md`` and ``plot.png`` to the run directory
(``loadtest.soak.report``) and exits non-zero if an invariant failed.

The short form (the default, 180 s) fires every fault once; ``--duration 1800`` repeats the
cycle of faults about every five minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
import time
import tomllib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import aiohttp

from loadtest import procs
from loadtest.soak import prom as soak_prom
from loadtest.soak.aborts import AbortFigures, check_aborts, client_leaving
from loadtest.soak.changes import (
    KeyedChange,
    LogLoss,
    Outage,
    ViewRead,
    check_answers,
    check_log_losses,
    check_replica_logs,
    check_views,
)
from loadtest.soak.chaos import Chaos
from loadtest.soak.client import CLIENT_TIMEOUT, Clock, execute, now_since
from loadtest.soak.config import BACKENDS, PRODUCTION_TOML, tier_of
from loadtest.soak.faults import (
    ADMIN_KINDS,
    REDIS_FAULTS,
    FaultWindow,
    PlannedFault,
    overlapping,
    plan_faults,
    probe_times,
    probed_key_quiet,
)
from loadtest.soak.fleet import REPLICAS, SIM_ARGS, Fleet
from loadtest.soak.invariants import (
    AdminChange,
    LeakState,
    LimitsProbe,
    MemorySample,
    ProbeSample,
    Verdict,
    check_admin_changes,
    check_availability,
    check_bad_input,
    check_faults,
    check_gateway_errors,
    check_limits,
    check_memory,
    check_no_leak,
    check_no_request_lost,
    check_traces,
)
from loadtest.soak.mix import PROBED_KEY, Mix
from loadtest.soak.outcomes import Observation, classify
from loadtest.soak.redis_faults import RedisFaults
from loadtest.soak.report import markdown, plot, timeline, write_json

POLL_INTERVAL_S: Final = 0.5
WARM_UP_SHARE: Final = 0.25
_POLL_TIMEOUT: Final = aiohttp.ClientTimeout(total=2.0)


@dataclass(frozen=True, slots=True)
class SoakOptions:
    duration: float = 180.0
    concurrency: int = 20
    seed: int = 0
    out: Path | None = None
    production: Path = PRODUCTION_TOML
    settle_within: float = 20.0

    @property
    def sample_every(self) -> float:
        """Seconds between memory samples: ~90 per run, between 1 and 10 s apart."""
        return min(10.0, max(1.0, self.duration / 90))


@dataclass(slots=True)
class Recorded:
    """Everything a run collected, for ``evaluate`` and the report."""

    duration: float
    plan: tuple[PlannedFault, ...]
    observations: list[Observation] = field(default_factory=list)
    polls: list[ProbeSample] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)
    windows: list[FaultWindow] = field(default_factory=list)
    probes: list[LimitsProbe] = field(default_factory=list)
    changes: list[AdminChange] = field(default_factory=list)
    leak: LeakState | None = None
    aborts: AbortFigures | None = None
    otlp_posts: int = 0
    keyed: list[KeyedChange] = field(default_factory=list)  # changes made under Redis faults
    view_reads: list[ViewRead] = field(default_factory=list)
    outages: list[Outage] = field(default_factory=list)  # Redis paused or dead
    log_losses: list[LogLoss] = field(default_factory=list)
    replica_logs: dict[str, str] = field(default_factory=dict)  # each replica's log, at the end

    @property
    def warm_until(self) -> float:
        return WARM_UP_SHARE * self.duration


def evaluate(rec: Recorded) -> list[Verdict]:
    """Every invariant's verdict on a run's records."""
    results = [(o, classify(o)) for o in rec.observations]
    verdicts = [
        check_no_leak(rec.leak)
        if rec.leak is not None
        else Verdict("no_leak", False, "not measured"),
    ]
    if rec.aborts is not None:
        verdicts.append(check_aborts(rec.aborts, client_leaving(rec.observations, rec.windows)))
    else:
        verdicts.append(Verdict("aborted_upstream", False, "not measured"))
    verdicts += [
        check_no_request_lost(results, rec.windows, BACKENDS),
        check_availability(rec.polls, rec.windows, BACKENDS, REPLICAS),
        check_gateway_errors(results),
        check_bad_input(results),
        check_limits(rec.probes),
        check_memory(rec.memory, rec.warm_until, REPLICAS),
        check_admin_changes(rec.changes, sum(f.kind in ADMIN_KINDS for f in rec.plan)),
        check_answers(rec.keyed, sum(f.kind in REDIS_FAULTS for f in rec.plan)),
        check_views(rec.view_reads, rec.outages, REPLICAS),
        check_log_losses(rec.log_losses, sum(f.kind == "redis_kill" for f in rec.plan)),
        check_replica_logs(rec.replica_logs, len(rec.outages)),
        check_faults(rec.plan, rec.windows),
        check_traces(rec.otlp_posts),
    ]
    return verdicts


@dataclass(frozen=True, slots=True)
class SoakResult:
    out: Path
    verdicts: list[Verdict]
    doc: dict[str, Any]

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts)

    @property
    def failed(self) -> list[Verdict]:
        return [v for v in self.verdicts if not v.passed]


async def _poll(
    *,
    fleet: Fleet,
    session: aiohttp.ClientSession,
    replica: int,
    rec: Recorded,
    clock: Clock,
    stop: asyncio.Event,
    sample_every: float,
) -> None:
    """/ready and /metrics every half second; memory and series every ``sample_every``."""
    url = fleet.gateways[replica].url
    pid = fleet.gateways[replica].pid
    last_sample = -sample_every
    while not stop.is_set():
        for path in ("/ready", "/metrics"):
            t = clock()
            status, text, error = 0, "", None
            try:
                async with session.get(url + path) as resp:
                    status, text = resp.status, await resp.text()
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            rec.polls.append(ProbeSample(t, replica, path, status, clock() - t, error))
            if path == "/metrics" and status == 200 and t - last_sample >= sample_every:
                last_sample = t
                found = soak_prom.samples(text)
                rec.memory.append(
                    MemorySample(
                        t,
                        replica,
                        procs.rss_bytes(pid),
                        soak_prom.series_count(text),
                        soak_prom.total(found, "llm_gateway_backend_in_flight"),
                        soak_prom.total(found, "llm_gateway_prefix_index_bytes"),
                    )
                )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_INTERVAL_S)


async def _settle(
    fleet: Fleet, session: aiohttp.ClientSession, within: float, t0_unix: float
) -> LeakState:
    """Poll what the fleet still holds until nothing is, or ``within`` seconds have passed."""
    started = time.monotonic()
    while True:
        gauges = [await fleet.gateway_gauges(session, r) for r in range(REPLICAS)]
        sims: dict[str, tuple[int, int] | None] = {}
        for name in BACKENDS:
            state = await fleet.sim_state(session, name)
            sims[name] = None if state is None else (int(state["running"]), int(state["waiting"]))
        waited = time.monotonic() - started
        leak = LeakState(gauges, await fleet.redis_slots(), sims, waited)
        if not leak.problems() or waited > within:
            break
        await asyncio.sleep(0.25)  # sleep-ok: polling for the fleet to settle, with a deadline
    if leak.redis_slots:  # the evidence for a diagnosis
        taken = [t - t0_unix for t in await fleet.redis_slot_times()]
        timeouts = [t - t0_unix for t in fleet.store_timeouts()]
        leak = replace(leak, slots_taken_at=tuple(taken), store_timeouts_at=tuple(timeouts))
    return leak


async def _abort_figures(fleet: Fleet, session: aiohttp.ClientSession) -> AbortFigures:
    by_phase: Counter[str] = Counter(fleet.carried_aborts)
    for name in BACKENDS:
        by_phase.update(await fleet.sim_aborts(session, name) or {})
    reasons: Counter[str] = Counter()
    down = 0.0
    for r in range(REPLICAS):
        text = await fleet.gateway_metrics(session, r) or ""
        found = soak_prom.samples(text)
        reasons.update(soak_prom.by_label(found, "llm_gateway_upstream_aborts_total", "reason"))
        down += soak_prom.total(found, "llm_gateway_retries_total", reason="BackendDown")
    return AbortFigures(
        sim_aborted=float(sum(by_phase.values())),
        sim_aborted_by_phase=dict(by_phase),
        gateway_aborts=dict(reasons),
        gateway_backend_down_retries=down,
    )


async def _drive(fleet: Fleet, rec: Recorded, options: SoakOptions, mix: Mix, rpm: int) -> None:
    """The load, the faults and the polls at once; then the settle and the final counts."""
    t0, t0_unix = time.monotonic(), time.time()
    clock = now_since(t0)
    probes = probe_times(rec.plan)
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        aiohttp.ClientSession(
            connector=connector, timeout=CLIENT_TIMEOUT, auto_decompress=False
        ) as load,
        aiohttp.ClientSession(timeout=_POLL_TIMEOUT) as ops,
    ):
        chaos = Chaos(fleet, ops, load, clock, t0, rpm, RedisFaults(fleet, ops, clock))
        stop = asyncio.Event()
        helpers = [
            asyncio.create_task(
                _poll(
                    fleet=fleet,
                    session=ops,
                    replica=r,
                    rec=rec,
                    clock=clock,
                    stop=stop,
                    sample_every=options.sample_every,
                )
            )
            for r in range(REPLICAS)
        ]
        faults = asyncio.create_task(chaos.run(rec.plan))
        helpers.append(faults)
        counter = itertools.count()

        async def client() -> None:
            while clock() < options.duration:
                quiet = chaos.probing or probed_key_quiet(clock(), probes)
                p = mix.next(next(counter), probed_key_allowed=not quiet)
                rec.observations.append(await execute(load, fleet.urls[p.replica], p, clock))

        try:
            await asyncio.gather(*(client() for _ in range(options.concurrency)))
            await faults
            rec.leak = await _settle(fleet, ops, options.settle_within, t0_unix)
            rec.aborts = await _abort_figures(fleet, ops)
        finally:
            stop.set()  # the pollers end at their next turn; anything else is cancelled
            _, pending = await asyncio.wait(helpers, timeout=5.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
        rec.windows = chaos.windows
        rec.changes = chaos.changes
        rec.keyed = chaos.redis.changes
        rec.view_reads = chaos.redis.reads
        rec.outages = chaos.redis.outages
        rec.log_losses = chaos.redis.losses
        rec.probes = chaos.probes
        rec.observations += chaos.probe_observations
        rec.otlp_posts = fleet.sink.posts


async def run_soak(options: SoakOptions) -> SoakResult:
    """Run the soak; the verdicts and the result document (also written to ``out``)."""
    out = options.out or Path("runs") / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    production = tomllib.loads(options.production.read_text())
    rpm = int(tier_of(production, PROBED_KEY)["requests_per_minute"])
    plan = plan_faults(options.duration)
    clash = overlapping(plan)
    if clash:
        raise ValueError(f"faults too close together for {options.duration:g} s: {clash}")
    rec = Recorded(options.duration, plan)
    fleet = Fleet(out, production)
    mix = Mix(options.seed, REPLICAS)
    started_at = time.time()
    wall0 = time.monotonic()
    try:
        await fleet.start()
        await _drive(fleet, rec, options, mix, rpm)
    finally:
        await fleet.stop()
    rec.replica_logs = {g.name: g.log_path.read_text(errors="replace") for g in fleet.gateways}
    verdicts = evaluate(rec)
    wall = time.monotonic() - wall0
    doc = _document(
        rec, verdicts=verdicts, options=options, out=out, started_at=started_at, wall=wall
    )
    write_json(out / "result.json", doc)
    (out / "report.md").write_text(markdown(doc))
    plot(doc, out / "plot.png")
    return SoakResult(out, verdicts, doc)


def _document(
    rec: Recorded,
    *,
    verdicts: Sequence[Verdict],
    options: SoakOptions,
    out: Path,
    started_at: float,
    wall: float,
) -> dict[str, Any]:
    results = [(o, classify(o)) for o in rec.observations]
    memory: dict[str, Any] = next(
        (v.figures["replicas"] for v in verdicts if v.name == "memory_flat"), {}
    )
    end = max((o.end for o in rec.observations), default=rec.duration)
    return {
        "title": (
            f"soak of {options.production.name}: {options.duration:g} s, "
            f"{options.concurrency} clients, seed {options.seed}, {REPLICAS} replicas"
        ),
        "out": str(out),
        "started_at": started_at,
        "wall_s": round(wall, 1),
        "duration_s": options.duration,
        "concurrency": options.concurrency,
        "seed": options.seed,
        "warm_until_s": rec.warm_until,
        "passed": all(v.passed for v in verdicts),
        "invariants": [v.to_json() for v in verdicts],
        "requests": {
            "total": len(results),
            "by_outcome": dict(sorted(Counter(c for _, c in results).items())),
            "by_behaviour": dict(sorted(Counter(o.behaviour for o, _ in results).items())),
        },
        "faults": {
            "planned": [
                {
                    "at_s": round(f.at, 2),
                    "kind": f.kind,
                    "target": f.target,
                    "hold_s": f.hold,
                    "params": dict(f.params),
                }
                for f in rec.plan
            ],
            "windows": [w.to_json() for w in rec.windows],
        },
        "memory": memory,
        "limits_probes": [p.to_json() for p in rec.probes],
        "traces": {"otlp_posts": rec.otlp_posts},
        "samples": [
            {
                "t": round(s.t, 2),
                "replica": s.replica,
                "rss_mb": round(s.rss / 2**20, 2),
                "series": s.series,
                "in_flight": s.in_flight,
                "prefix_index_mb": round(s.prefix_index_bytes / 2**20, 3),
            }
            for s in rec.memory
        ],
        "timeline": timeline(results, rec.windows, BACKENDS, end=end),
        "config": {
            "production": str(options.production),
            "backends": list(BACKENDS),
            "sim_args": list(SIM_ARGS),
        },
    }


def main_from_args(args: argparse.Namespace) -> int:
    from loadtest.client import run

    if args.duration <= 0 or args.concurrency < 1:
        print("llm-gateway loadtest soak: --duration must be > 0 and --concurrency >= 1")
        return 2
    options = SoakOptions(
        duration=args.duration,
        concurrency=args.concurrency,
        seed=args.seed,
        out=args.out,
        production=args.config or PRODUCTION_TOML,
    )
    print(f"soak: {options.duration:g} s, {options.concurrency} clients ...", flush=True)
    try:
        result: SoakResult = run(run_soak(options))
    except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
        print(f"llm-gateway loadtest soak: could not run: {exc}", file=sys.stderr)
        return 1
    for v in result.verdicts:
        print(f"{'PASS' if v.passed else 'FAIL'}  {v.name}: {v.why}")
    print(f"results: {result.out / 'result.json'}  report: {result.out / 'report.md'}")
    if not result.passed:
        names = ", ".join(v.name for v in result.failed)
        print(f"soak failed: {names}", file=sys.stderr)
        return 1
    return 0
