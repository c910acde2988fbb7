"""``python -m loadtest.peers``: the peer bench's command line (see ``driver`` for what a run
does, ``docs/bench/README.md`` for the runs the docs cite)."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import signal
import sys
import time
from types import FrameType
from typing import Any, NoReturn

from loadtest.peers import driver
from loadtest.peers.procs import log, sh
from loadtest.peers.report import render_md
from loadtest.peers.targets import BUILTIN_TARGETS, REPO, default_repo_python


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.peers",
        description=driver.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = ap.add_argument
    add("--only", default="", help="comma-separated target names (default: all)")
    add(
        "--target",
        action="append",
        default=[],
        metavar="NAME=CMD_TEMPLATE",
        help="add/override a target: command template with {port}, {backends}, ... placeholders",
    )
    add(
        "--target-env",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE",
        help="extra environment variable for a target",
    )
    add(
        "--target-key",
        action="append",
        default=[],
        metavar="NAME=API_KEY",
        help="bearer key loadgen sends to a target ({api_key} in its templates)",
    )
    add("--profiles", default="fast,paced")
    add("--levels", default="1,64,256,1024")
    add(
        "--survive-gate",
        type=int,
        default=1024,
        help="levels >= this run only if the previous level had error rate <= --max-error-rate",
    )
    add("--max-error-rate", type=float, default=0.01)
    add("--duration", type=float, default=10.0)
    add("--duration-c1", type=float, default=15.0)
    add("--grace", type=float, default=20.0)
    add("--warmup", type=float, default=3.0)
    add("--warmup-concurrency", type=int, default=16)
    add("--pause", type=float, default=1.0)
    add("--endpoint", choices=["chat", "completions"], default="chat")
    add("--model", default="tiny")
    add("--proxy-cpu", type=int, default=0)
    add("--client-cpu", type=int, default=1)
    add("--proxy-port", type=int, default=18100)
    add("--backend-port", type=int, default=18001)
    add("--ready-timeout", type=float, default=60)
    add("--root", default="/tmp/peerbench", help="venvs and per-run logs go under it")
    add("--venvs", default="", help="the peers' venvs (default ROOT/venvs)")
    add(
        "--bench-python",
        default="",
        help="runs the fake backends and loadgen; needs aiohttp and uvloop (default: "
        "--repo-python, or ROOT/venvs/bench made by --install when that lacks them)",
    )
    add(
        "--repo-python",
        default=default_repo_python(),
        help="runs this checkout's targets (gw, raw, lean, bare): {repo_python} "
        "(default: the checkout's .venv, else this Python)",
    )
    add("--install", action="store_true", help="create missing venvs / apt packages")
    add("--install-timeout", type=int, default=900)
    add(
        "--give-up-early",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="skip a target's other profiles if it failed to start on the first",
    )
    add(
        "--results-dir",
        default=driver.RESULTS,
        help="where peers-<date>[-<label>].json and .md go (default: docs/bench/)",
    )
    add(
        "--label",
        "--tag",
        dest="tag",
        metavar="LABEL",
        default="",
        help="suffix for result file names",
    )
    add("--render", default="", help="only re-render the markdown for this results JSON")
    return ap.parse_args(argv)


def _has_aiohttp(python: str) -> bool:
    return sh(f"{shlex.quote(python)} -c 'import aiohttp, uvloop'", timeout=60).returncode == 0


def _bench_python(args: argparse.Namespace, logdir: str) -> str:
    if args.bench_python:
        if not os.path.exists(args.bench_python):
            sys.exit(f"{args.bench_python} missing")
        return str(args.bench_python)
    if _has_aiohttp(args.repo_python):
        return str(args.repo_python)
    venv = os.path.join(args.venvs, "bench")
    python = os.path.join(venv, "bin", "python")
    if os.path.exists(python):
        return python
    if not args.install:
        sys.exit(f"{args.repo_python} lacks aiohttp/uvloop; run with --install or --bench-python")
    r = sh(
        f"{sys.executable} -m venv {venv} && {venv}/bin/pip install aiohttp uvloop",
        log_path=os.path.join(logdir, "install-bench.log"),
    )
    if r.returncode != 0:
        sys.exit("could not install bench venv: " + r.stderr[-500:])
    return python


def _targets(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    targets = {n: dict(spec) for n, spec in BUILTIN_TARGETS.items()}
    for t in args.target:
        n, _, cmd = t.partition("=")
        targets[n] = {"cmd": cmd, "version": "custom", "note": "custom target"}
    for t in args.target_key:
        n, _, k = t.partition("=")
        targets[n]["api_key"] = k
    for t in args.target_env:
        n, _, kv = t.partition(":")
        k, _, v = kv.partition("=")
        targets[n]["env"] = {**targets[n].get("env", {}), k: v}
    return targets


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def _shown(path: str) -> str:
    """A path inside the checkout as relative to it, so that results name no one's machine."""
    rel = os.path.relpath(os.path.abspath(path), REPO)
    return path if rel.startswith("..") else rel


def _meta(args: argparse.Namespace, date: str, stamp: str, logdir: str) -> dict[str, Any]:
    bv = sh(
        f'{args.bench_python} -c "import aiohttp,sys; import uvloop; '
        f'print(aiohttp.__version__, uvloop.__version__, sys.version.split()[0])"',
        timeout=60,
    ).stdout.split()
    shown_args = dict(vars(args))
    shown_args["results_dir"] = _shown(args.results_dir)
    return {
        "date": date,
        "stamp": stamp,
        "host": platform.node(),
        "cpu": _cpu_model(),
        "nproc": os.cpu_count(),
        "kernel": platform.release(),
        "python": bv[2] if len(bv) > 2 else platform.python_version(),
        "bench_aiohttp": bv[0] if bv else None,
        "bench_uvloop": bv[1] if len(bv) > 1 else None,
        "logdir": logdir,
        "args": shown_args,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.render:
        with open(args.render) as f:
            res = json.load(f)
        md = args.render[:-5] + ".md" if args.render.endswith(".json") else args.render + ".md"
        with open(md, "w") as f:
            f.write(render_md(res))
        print(md)
        return

    args.venvs = args.venvs or os.path.join(args.root, "venvs")
    args.levels = [int(x) for x in args.levels.split(",") if x]
    args.profiles = [x for x in args.profiles.split(",") if x]
    targets = _targets(args)
    names = [x for x in args.only.split(",") if x] or list(targets)
    if "direct" not in names:
        log("note: 'direct' not selected; ratios will be blank")

    date = _dt.date.today().isoformat()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logdir = os.path.join(args.root, "runs", stamp)
    os.makedirs(logdir, exist_ok=True)
    os.makedirs(args.results_dir, exist_ok=True)
    args.bench_python = _bench_python(args, logdir)

    results: dict[str, Any] = {"meta": _meta(args, date, stamp, logdir), "targets": {}}
    base = os.path.join(args.results_dir, f"peers-{date}{('-' + args.tag) if args.tag else ''}")
    bench = driver.Bench(args, logdir, results)

    def save() -> None:
        with open(base + ".json", "w") as f:
            json.dump(results, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(render_md(results))

    def on_signal(signum: int, frame: FrameType | None) -> NoReturn:
        bench.procs.stop_all()
        save()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for n in names:
            if n not in targets:
                log(f"unknown target {n}")
                continue
            t0 = time.time()
            bench.target(n, targets[n])
            results["targets"][n]["bench_wall_s"] = round(time.time() - t0, 1)
            save()
    finally:
        bench.procs.stop_all()
        save()
    log(f"wrote {base}.json and {base}.md (logs in {logdir})")
