"""``llm-gateway loadtest``: run, scenario, compare, pool, overhead, report-all, soak.

Only argparse is imported at parser-build time; each subcommand imports what it needs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loadtest.client import Live
    from loadtest.report import LabeledRun
    from loadtest.stats import Slo
    from loadtest.workload import LengthDist


DESCRIPTION = (
    "Load tests with realistic LLM workloads: closed or open loop (Poisson or bursty), "
    "length distributions, shared prefixes, multi-turn sessions; TTFT, ITL, TPOT, E2E, "
    "throughput and goodput, as vLLM's benchmark_serving defines them. Scenarios start "
    "simulated backends and the gateway under a policy; compare runs one scenario under "
    "several policies; overhead measures what the gateway itself costs."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="loadtest_command", metavar="SUBCOMMAND", required=True)
    _add_run(sub)
    _add_scenario(sub)
    _add_compare(sub)
    _add_pool(sub)
    _add_overhead(sub)
    _add_report_all(sub)
    _add_soak(sub)


def _out_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        type=Path,
        help="directory for result.json, plot.png and logs (default runs/loadtest/NAME-TIME)",
    )


def _slo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT objective")
    p.add_argument("--slo-itl-ms", type=float, help="goodput: ITL (per-request TPOT) objective")


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("run", help="load a running server (the gateway, vLLM, anything OpenAI)")
    p.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--label", help="name of the run on the table and plots (default: the URL)")
    p.add_argument("--api-key", help="sent as a Bearer token")
    w = p.add_argument_group("workload")
    w.add_argument("--model", default="sim-model", help="model name sent in each request")
    w.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default="chat",
        help="/v1/chat/completions or /v1/completions",
    )
    w.add_argument("--no-stream", action="store_true", help="non-streaming requests")
    w.add_argument(
        "--prompt",
        default="chat",
        help="prompt length: N, uniform:LO:HI, lognormal:MEDIAN:SIGMA[:LO:HI] or chat",
    )
    w.add_argument("--output", default="fixed:64", help="output length, same forms as --prompt")
    w.add_argument("--prefix-groups", type=int, default=0, help="shared-prefix groups")
    w.add_argument("--prefix-len", type=int, default=0, help="tokens per shared prefix")
    w.add_argument("--hot-share", type=float, help="share of requests in prefix group 0")
    w.add_argument("--hot-len", type=int, help="tokens of group 0's prefix (default: --prefix-len)")
    w.add_argument("--turns", type=int, default=1, help="turns per multi-turn session")
    w.add_argument("--seed", type=int, default=0, help="seed of the generated workload")
    ld = p.add_argument_group("load")
    mode = ld.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, help="closed loop at this concurrency")
    mode.add_argument("--rate", type=float, help="open loop at this many requests/s")
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    ld.add_argument("--duration", type=float, help="measured seconds (default 10)")
    ld.add_argument("--requests", type=int, help="stop after this many requests")
    ld.add_argument("--warmup", type=float, default=0.0, help="seconds left out of the figures")
    _slo_args(p)
    _out_arg(p)
    p.set_defaults(func=_run)


def _add_scenario(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("scenario", help="run a scenario file (starts simulators and gateway)")
    p.add_argument("scenario", help="a bundled name (slow-backend, ...) or a TOML file")
    p.add_argument("--policy", help="gateway policy (default: the scenario's first)")
    _out_arg(p)
    p.set_defaults(func=_scenario)


def _add_compare(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("compare", help="one scenario under several policies, in one picture")
    p.add_argument("scenario", help="a bundled name (slow-backend, ...) or a TOML file")
    p.add_argument("--policies", help="comma-separated (default: the scenario's list)")
    _out_arg(p)
    p.set_defaults(func=_compare)


def _add_pool(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "pool", help="several runs' result.json as one sample per policy (pooled TTFT p50/p99)"
    )
    p.add_argument("results", nargs="+", type=Path, help="result.json files of one scenario")
    p.add_argument("--baseline", help="the label the p99 ratio is against (e.g. least_load)")
    p.set_defaults(func=_pool)


def _pool(args: argparse.Namespace) -> int:
    from loadtest.pool import PoolError, pool, table

    try:
        pooled = pool(args.results)
    except PoolError as exc:
        print(f"llm-gateway loadtest pool: {exc}")
        return 2
    if args.baseline and args.baseline not in pooled:
        print(f"llm-gateway loadtest pool: no runs labelled {args.baseline!r}")
        return 2
    print(table(pooled, args.baseline))
    return 0


def _add_overhead(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from loadtest.bench.overhead import add_arguments as overhead_arguments

    p = sub.add_parser(
        "overhead", help="the gateway's own cost: direct vs through one gateway process"
    )
    overhead_arguments(p)
    p.set_defaults(func=_overhead)


def _add_report_all(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("report-all", help="run every scenario and the overhead benchmark")
    p.add_argument(
        "--doc", type=Path, default=Path("docs/benchmarks.md"), help="the document rewritten"
    )
    p.add_argument("--img", type=Path, default=Path("docs/img"), help="where its plots go")
    p.add_argument("--quick", action="store_true", help="short runs, to check the pipeline")
    p.set_defaults(func=_report_all)


def _add_soak(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "soak",
        help="soak and chaos: the production configuration on two replicas, under faults, "
        "with its invariants checked (non-zero exit if one fails)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=180.0,
        help="seconds of load, at least 75 (default 180: every fault once; the long form is 1800)",
    )
    p.add_argument("--concurrency", type=int, default=20, help="concurrent clients (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument(
        "--config", type=Path, help="the TOML to run (default deploy/gateway.production.toml)"
    )
    p.add_argument("--out", type=Path, help="run directory (default runs/soak-TIME)")
    p.set_defaults(func=_soak)


def parse_length(spec: str) -> LengthDist:
    """``N``, ``fixed:N``, ``uniform:LO:HI``, ``lognormal:MEDIAN:SIGMA[:LO:HI]``, ``chat``."""
    from loadtest.workload import CHAT_PROMPT, LengthDist

    kind, _, rest = spec.partition(":")
    parts = rest.split(":") if rest else []
    try:
        if kind.isdigit():
            return LengthDist.fixed(int(kind))
        if kind == "chat":
            return CHAT_PROMPT
        if kind == "fixed" and len(parts) == 1:
            return LengthDist.fixed(int(parts[0]))
        if kind == "uniform" and len(parts) == 2:
            return LengthDist.uniform(int(parts[0]), int(parts[1]))
        if kind == "lognormal" and len(parts) in (2, 4):
            bounds = (int(parts[2]), int(parts[3])) if len(parts) == 4 else (1, 4096)
            return LengthDist.lognormal(float(parts[0]), float(parts[1]), *bounds)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad length {spec!r}: {exc}") from exc
    raise argparse.ArgumentTypeError(f"bad length {spec!r}")


def _slo(args: argparse.Namespace) -> Slo:
    from loadtest.stats import Slo

    def s(ms: float | None) -> float | None:
        return None if ms is None else ms / 1e3

    return Slo(ttft=s(args.slo_ttft_ms), itl=s(args.slo_itl_ms))


def _out_dir(args: argparse.Namespace, name: str) -> Path:
    if args.out is not None:
        out: Path = args.out
    else:
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
        out = Path("runs") / "loadtest" / f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    return out


@contextmanager
def progress(label: str) -> Iterator[Callable[[Live], None]]:
    """A rich progress bar; yields the ``on_tick`` callback for ``run_load``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[counts]}"),
        TimeElapsedColumn(),
        transient=False,
    ) as bar:
        task = bar.add_task(label, total=None, counts="")

        def on_tick(live: Live) -> None:
            if live.total_time is not None:
                total, done = live.total_time, min(live.elapsed, live.total_time)
            elif live.total_requests is not None:
                total, done = float(live.total_requests), float(live.sent)
            else:
                total, done = None, 0.0
            counts = f"sent {live.sent}  done {live.done}  errors {live.errors}"
            bar.update(task, total=total, completed=done, counts=counts)

        yield on_tick


def show(runs: Sequence[LabeledRun], out: Path, title: str, **meta: Any) -> None:
    """Table on the terminal, JSON and PNG in ``out``; warn about a distorted client."""
    from rich.console import Console

    from loadtest.report import plot, table, write_json

    console = Console()
    if not console.is_terminal:
        console = Console(width=180)
    console.print(table(runs, title))
    for r in runs:
        if r.warning:
            console.print(f"[yellow]warning ({r.label}): {r.warning}[/]")
    write_json(out / "result.json", runs, title=title, **meta)
    plot(runs, out / "plot.png", title)
    console.print(f"results: {out / 'result.json'}  plot: {out / 'plot.png'}")


def _run(args: argparse.Namespace) -> int:
    from loadtest.arrivals import ClosedLoop, LoadShape, OpenLoop
    from loadtest.client import ClientOptions, run, run_load
    from loadtest.report import LabeledRun
    from loadtest.workload import PrefixGroups, Workload

    try:
        workload = Workload(
            model=args.model,
            endpoint=args.endpoint,
            stream=not args.no_stream,
            prompt=parse_length(args.prompt),
            output=parse_length(args.output),
            prefix=PrefixGroups(args.prefix_groups, args.prefix_len, args.hot_share, args.hot_len),
            turns=args.turns,
            seed=args.seed,
        )
        arrivals = (
            OpenLoop(args.rate, args.burstiness)
            if args.rate is not None
            else ClosedLoop(args.concurrency or 1)
        )
        duration = args.duration if args.duration or args.requests else 10.0
        load = LoadShape(
            arrivals, duration=duration, requests=args.requests, warmup=args.warmup, seed=args.seed
        )
    except (ValueError, argparse.ArgumentTypeError) as exc:
        print(f"llm-gateway loadtest: {exc}")
        return 2
    label = args.label or args.url
    with progress(label) as on_tick:
        result = run(
            run_load(args.url, workload, load, ClientOptions(api_key=args.api_key), on_tick=on_tick)
        )
    show([LabeledRun.of(label, result, _slo(args))], _out_dir(args, "run"), load.describe())
    return 0


def _scenario_runs(name: str, policies: Sequence[str] | None, out: Path | None) -> int:
    from loadtest.client import run
    from loadtest.scenario import ScenarioError, load_scenario, run_scenario

    try:
        sc = load_scenario(name)
    except ScenarioError as exc:
        print(f"llm-gateway loadtest: {exc}")
        return 2
    out_dir = _out_dir(argparse.Namespace(out=out), sc.name)
    runs = []
    for policy in policies or sc.policies:
        with progress(f"{sc.name} / {policy}") as on_tick:
            try:
                runs.append(run(run_scenario(sc, policy, out_dir, on_tick=on_tick)))
            except (RuntimeError, TimeoutError, OSError) as exc:
                print(f"llm-gateway loadtest: {sc.name} / {policy} failed: {exc}")
    if not runs:
        return 1
    title = f"{sc.name}: {sc.load.describe()}"
    show(runs, out_dir, title, scenario=sc.name, description=sc.description)
    return 0


def _scenario(args: argparse.Namespace) -> int:
    return _scenario_runs(args.scenario, [args.policy] if args.policy else None, args.out)


def _compare(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",")] if args.policies else None
    return _scenario_runs(args.scenario, policies, args.out)


def _overhead(args: argparse.Namespace) -> int:
    from loadtest.bench.overhead import main_from_args

    return main_from_args(args)


def _soak(args: argparse.Namespace) -> int:
    from loadtest.soak.runner import main_from_args

    return main_from_args(args)


def _report_all(args: argparse.Namespace) -> int:
    from loadtest.benchdoc import regenerate

    return regenerate(args.doc, args.img, quick=args.quick)
