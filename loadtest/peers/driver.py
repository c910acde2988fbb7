"""Side-by-side benchmark of LLM gateways forwarding OpenAI-style SSE streams.

For each target: start two fake vLLM backends (``python -m tools.fake_vllm``) on CPU 1, start
the target proxy on CPU 0 pointing at both, wait until a request goes through, warm up, then
run loadtest/peers/loadgen.py (on CPU 1) at several concurrencies for each backend profile.
Records loadgen stats plus the proxy's CPU use and RSS (summed over its process tree) and the
two fake backends' CPU use (what the load costs the backends themselves). Writes
docs/bench/peers-<date>[-<label>].json and .md (or into --results-dir).

Stdlib only; the backends (as a module, the checkout on PYTHONPATH) and loadgen (as a file) run
under --bench-python (needs aiohttp, uvloop).
Targets are command templates (loadtest/peers/targets.py): the peers (nginx, vllm-router,
sglang-router, litellm), the gateway of this checkout (gw) and the floors of scripts/proxy_cost
(raw, lean, bare); --target adds one from the command line.

Examples:
  python -m loadtest.peers --install                        # all built-in targets
  python -m loadtest.peers --only direct,gw --levels 1,64 --duration 5
  python -m loadtest.peers --only direct,mygw \\
      --target 'mygw=/path/venv/bin/python -m mygw --port {port} --backends {backends_csv}'
  python -m loadtest.peers --render docs/bench/peers-2026-12-04-floors.json   # re-make the .md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any, Final

from loadtest.peers.procs import (
    Procs,
    Sampler,
    log,
    port_free,
    tail,
    tree_usage,
    wait_ready,
)
from loadtest.peers.targets import (
    PROFILES,
    REPO,
    ensure_installed,
    render_ctx,
    version_of,
)

HERE: Final = os.path.dirname(os.path.abspath(__file__))
RESULTS: Final = os.path.join(REPO, "docs", "bench")


def run_loadgen(
    args: argparse.Namespace,
    url: str,
    *,
    conc: int,
    max_tokens: int,
    duration: float,
    label: str,
    out_path: str,
    logdir: str,
    api_key: str = "",
) -> dict[str, Any]:
    cmd = [
        "taskset", "-c", str(args.client_cpu), args.bench_python, os.path.join(HERE, "loadgen.py"),
        "--url", url, "--endpoint", args.endpoint, "--model", args.model, "-c", str(conc),
        "-d", str(duration), "--grace", str(args.grace), "-t", str(max_tokens),
        "--label", label, "--out", out_path,
    ]  # fmt: skip
    if api_key:
        cmd += ["--api-key", api_key]
    try:
        r = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=duration + args.grace + 60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": "loadgen timed out"}
    with open(os.path.join(logdir, "loadgen.log"), "a") as f:
        f.write(f"$ {' '.join(cmd)}\nrc={r.returncode}\n{r.stderr[-2000:]}\n")
    if r.returncode != 0:
        return {"error": f"loadgen rc={r.returncode}: {r.stderr[-500:]}"}
    with open(out_path) as f:
        result: dict[str, Any] = json.load(f)
    return result


class Bench:
    """One run: the arguments, the processes it started, the results so far."""

    def __init__(self, args: argparse.Namespace, logdir: str, results: dict[str, Any]) -> None:
        self.args = args
        self.logdir = logdir
        self.results = results
        self.procs = Procs(cwd=HERE)

    def target(self, name: str, spec: dict[str, Any]) -> None:
        args = self.args
        tres: dict[str, Any] = {"status": "ok", "note": spec.get("note", ""), "profiles": {}}
        self.results["targets"][name] = tres
        if spec.get("cmd") is not None:
            ok, msg = ensure_installed(name, spec, args, self.logdir)
            tres["install"] = msg
            if not ok:
                tres["status"] = "failed"
                tres["error"] = "install: " + msg
                log(f"[{name}] install failed: {msg}")
                return
            tres["version"] = version_of(name, spec, args)
            log(f"[{name}] version: {tres['version']}")
        for prof_name in args.profiles:
            pres: dict[str, Any] = {"desc": PROFILES[prof_name]["desc"], "levels": {}}
            tres["profiles"][prof_name] = pres
            self._profile(name, spec, prof_name, tres, pres)
            # stop trying this peer if it failed outright on the first profile
            if (
                pres.get("error")
                and not pres["levels"]
                and prof_name == args.profiles[0]
                and args.give_up_early
            ):
                tres["status"] = "failed"
                tres["error"] = pres["error"]
                break

    def _profile(
        self,
        name: str,
        spec: dict[str, Any],
        prof_name: str,
        tres: dict[str, Any],
        pres: dict[str, Any],
    ) -> None:
        args = self.args
        prof = PROFILES[prof_name]
        backend_ports = [args.backend_port, args.backend_port + 1]
        workdir = os.path.join(self.logdir, f"{name}-{prof_name}")
        os.makedirs(workdir, exist_ok=True)
        for p in [*backend_ports, args.proxy_port, args.proxy_port + 1]:
            if not port_free(p):
                time.sleep(2)  # the previous target's sockets, in TIME_WAIT
        backends: list[subprocess.Popen[bytes]] = []
        proxy = None
        try:
            self._start_backends(backends, backend_ports, prof, workdir)
            ctx = render_ctx(args, name, workdir, backend_ports, spec.get("api_key", ""))
            if spec.get("cmd") is None:
                url = ",".join(f"http://127.0.0.1:{p}" for p in backend_ports)
            else:
                for fname, tmpl in (spec.get("files") or {}).items():
                    Path(workdir, fname).write_text(tmpl.format(**ctx))
                cmd = spec["cmd"].format(**ctx)
                tres["command"] = cmd
                env = {k: v.format(**ctx) for k, v in (spec.get("env") or {}).items()}
                if env:
                    tres["env"] = env
                proxy_log = os.path.join(workdir, "proxy.log")
                log(f"[{name}/{prof_name}] starting: {cmd}")
                proxy = self.procs.start(shlex.split(cmd), args.proxy_cpu, proxy_log, env)
                url = f"http://127.0.0.1:{args.proxy_port}"
                ok, info = wait_ready(
                    url,
                    args.model,
                    proxy,
                    spec.get("ready_timeout", args.ready_timeout),
                    api_key=spec.get("api_key", ""),
                )
                if not ok:
                    raise RuntimeError(f"{info}; log tail:\n{tail(proxy_log)}")
                pres["startup_s"] = info
                pres["idle_rss_mb"] = round(tree_usage(proxy.pid)[0], 1)
            self._levels(
                name,
                spec,
                prof_name=prof_name,
                prof=prof,
                url=url,
                workdir=workdir,
                proxy=proxy,
                backends=backends,
                pres=pres,
            )
        except Exception as e:
            pres["error"] = str(e)[-3000:]
            tres["status"] = (
                "failed"
                if not any("levels" in v and v["levels"] for v in tres["profiles"].values())
                else "partial"
            )
            log(f"[{name}/{prof_name}] FAILED: {str(e)[:500]}")
        finally:
            self.procs.stop(proxy)
            for b in backends:
                self.procs.stop(b)

    def _start_backends(
        self,
        started: list[subprocess.Popen[bytes]],
        ports: list[int],
        prof: dict[str, Any],
        workdir: str,
    ) -> None:
        """Start the two fake backends (into ``started`` as they start, for the caller to stop)
        and wait until each answers."""
        args = self.args
        for p in ports:
            cmd = [args.bench_python, "-m", "tools.fake_vllm", "--port", str(p)]
            cmd += ["--model", args.model, "--ttft-ms", str(prof["ttft_ms"])]
            cmd += ["--itl-ms", str(prof["itl_ms"]), "--log-unknown"]
            log_path = os.path.join(workdir, f"backend-{p}.log")
            env = {"PYTHONPATH": REPO}  # tools.fake_vllm needs only aiohttp
            started.append(self.procs.start(cmd, args.client_cpu, log_path, env))
        for p in ports:
            ok, _ = wait_ready(f"http://127.0.0.1:{p}", args.model, None, 20)
            if not ok:
                raise RuntimeError(
                    f"fake backend on {p} did not start: "
                    + tail(os.path.join(workdir, f"backend-{p}.log"))
                )

    def _levels(
        self,
        name: str,
        spec: dict[str, Any],
        *,
        prof_name: str,
        prof: dict[str, Any],
        url: str,
        workdir: str,
        proxy: subprocess.Popen[bytes] | None,
        backends: list[subprocess.Popen[bytes]],
        pres: dict[str, Any],
    ) -> None:
        args = self.args
        wu = run_loadgen(
            args,
            url,
            conc=args.warmup_concurrency,
            max_tokens=prof["max_tokens"],
            duration=args.warmup,
            label="warmup",
            out_path=os.path.join(workdir, "warmup.json"),
            logdir=workdir,
            api_key=spec.get("api_key", ""),
        )
        pres["warmup"] = {k: wu.get(k) for k in ("requests_ok", "errors", "timeouts", "error")}
        if proxy is not None:
            pres["post_warmup_rss_mb"] = round(tree_usage(proxy.pid)[0], 1)
        for conc in args.levels:
            if conc >= args.survive_gate and pres["levels"]:
                prev = pres["levels"][str(max(int(k) for k in pres["levels"]))]
                n = (
                    (prev.get("requests_ok") or 0)
                    + (prev.get("errors") or 0)
                    + (prev.get("timeouts") or 0)
                )
                bad = (prev.get("errors") or 0) + (prev.get("timeouts") or 0)
                if prev.get("error") or n == 0 or bad / n > args.max_error_rate:
                    pres["levels"][str(conc)] = {
                        "skipped": f"previous level failed (errors/timeouts {bad}/{n})"
                    }
                    log(f"[{name}/{prof_name}] c={conc} skipped")
                    continue
            if proxy is not None and proxy.poll() is not None:
                pres["levels"][str(conc)] = {"skipped": f"proxy exited rc={proxy.returncode}"}
                continue
            dur = args.duration_c1 if conc == 1 else args.duration
            sampler = None
            cpu0 = 0.0
            if proxy is not None:
                _, cpu0 = tree_usage(proxy.pid)
                sampler = Sampler(proxy.pid)
                sampler.start()
            backends_cpu0 = sum(tree_usage(b.pid)[1] for b in backends)
            t0 = time.time()
            res = run_loadgen(
                args,
                url,
                conc=conc,
                max_tokens=prof["max_tokens"],
                duration=dur,
                label=f"{name}/{prof_name}/c{conc}",
                out_path=os.path.join(workdir, f"c{conc}.json"),
                logdir=workdir,
                api_key=spec.get("api_key", ""),
            )
            wall = time.time() - t0
            ev = (res.get("events_per_s") or 0) * (res.get("duration_s") or 0)
            backends_cpu = sum(tree_usage(b.pid)[1] for b in backends) - backends_cpu0
            res["backends_cpu_pct"] = round(100.0 * backends_cpu / wall, 1) if wall > 0 else None
            res["backends_cpu_us_per_event"] = round(backends_cpu * 1e6 / ev, 2) if ev else None
            if proxy is not None and sampler is not None:
                peak = sampler.finish()
                rss, cpu1 = tree_usage(proxy.pid)
                res["proxy_cpu_pct"] = round(100.0 * (cpu1 - cpu0) / wall, 1) if wall > 0 else None
                res["proxy_cpu_us_per_event"] = round((cpu1 - cpu0) * 1e6 / ev, 2) if ev else None
                res["proxy_peak_rss_mb"] = round(max(peak, rss), 1)
                res["proxy_alive"] = proxy.poll() is None
            pres["levels"][str(conc)] = res
            log(
                f"[{name}/{prof_name}] c={conc}: ok={res.get('requests_ok')} "
                f"err={res.get('errors')} to={res.get('timeouts')} "
                f"ttft_p50={res.get('ttft_ms', {}).get('p50')} ev/s={res.get('events_per_s')} "
                f"cpu%={res.get('proxy_cpu_pct')} rss={res.get('proxy_peak_rss_mb')} "
                f"backends cpu%={res.get('backends_cpu_pct')} "
                f"{res.get('error', '')}"
            )
            time.sleep(args.pause)
