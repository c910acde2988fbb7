"""Can one simulator process keep up with its own simulated clock under load?

Starts ``llm-gateway sim`` in a subprocess (so the client's CPU is not the
simulator's), keeps ``--concurrency`` streaming completions in flight for
``--duration`` seconds, and prints:

- clock lag: wall time the engine loop took for its steps vs their simulated
  duration, over the measured window (``/sim/state``'s busy counters), and the worst
  instantaneous lag;
- the simulator's CPU time (utime + stime from ``/proc/<pid>/stat``);
- tokens/s received by the client and engine steps/s.

Run: ``.venv/bin/python -m loadtest.bench.sim`` (1,000 streams, 1,024 seqs, 20 s), or
``--sim-defaults`` to run the simulator with its default settings (256 seqs, queueing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO, Any

import aiohttp

_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class ClientStats:
    tokens: int = 0
    completed: int = 0
    failed: int = 0
    ttfts: list[float] = field(default_factory=list)


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # fields 14 and 15 of stat


def start_sim(
    args: argparse.Namespace, token: str, log: IO[str]
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the simulator on a free port; its stderr goes to ``log`` (never blocks it)."""
    cmd = [
        sys.executable, "-m", "gateway", "sim", "--port", "0", "--admin-token", token,
    ]  # fmt: skip
    if not args.sim_defaults:
        cmd += [
            "--max-num-seqs", str(args.max_num_seqs),
            "--num-gpu-blocks-override", str(args.kv_blocks),
        ]  # fmt: skip
    cmd += args.sim_args
    proc = subprocess.Popen(cmd, stderr=log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        log.seek(0)
        match = re.search(r"on (http://\S+)", log.read())
        if match:
            return proc, match.group(1)
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    log.seek(0)
    raise SystemExit(f"simulator did not start: {log.read()}")


async def stream_worker(
    session: aiohttp.ClientSession,
    url: str,
    worker: int,
    *,
    stop_at: float,
    max_tokens: int,
    prompt_words: int,
    stats: ClientStats,
) -> None:
    shared = " ".join(f"system{i}" for i in range(prompt_words // 2))
    n = 0
    while time.monotonic() < stop_at:
        n += 1
        unique = " ".join(f"w{worker}x{n}y{i}" for i in range(prompt_words - prompt_words // 2))
        body = {
            "prompt": f"{shared} {unique}",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        t0 = time.monotonic()
        first = True
        try:
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    stats.failed += 1
                    continue
                async for chunk in resp.content.iter_any():
                    if first:
                        stats.ttfts.append(time.monotonic() - t0)
                        first = False
                    stats.tokens += chunk.count(b'"text":')
                    if time.monotonic() > stop_at:
                        return  # closing the connection aborts the request
            stats.completed += 1
        except aiohttp.ClientError:
            stats.failed += 1


async def sim_state(session: aiohttp.ClientSession, url: str, token: str) -> dict[str, Any]:
    async with session.get(
        f"{url}/sim/state", headers={"Authorization": f"Bearer {token}"}
    ) as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def bench(args: argparse.Namespace) -> int:
    token = secrets.token_hex(8)
    with tempfile.TemporaryFile("w+") as log:
        proc, url = start_sim(args, token, log)
        try:
            return await measure(args, proc, url, token)
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def measure(
    args: argparse.Namespace, proc: subprocess.Popen[bytes], url: str, token: str
) -> int:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        stats = ClientStats()
        t_start = time.monotonic()
        stop_at = t_start + args.warmup + args.duration
        workers = [
            asyncio.create_task(
                stream_worker(
                    session,
                    url,
                    i,
                    stop_at=stop_at,
                    max_tokens=args.max_tokens,
                    prompt_words=args.prompt_words,
                    stats=stats,
                )
            )
            for i in range(args.concurrency)
        ]
        await asyncio.sleep(args.warmup)
        s0 = await sim_state(session, url, token)
        cpu0, tok0, w0 = cpu_seconds(proc.pid), stats.tokens, time.monotonic()
        peak_running = 0
        peak_waiting = 0
        max_lag = 0.0
        while time.monotonic() < stop_at - 0.5:
            await asyncio.sleep(0.5)
            s = await sim_state(session, url, token)
            peak_running = max(peak_running, s["running"])
            peak_waiting = max(peak_waiting, s["waiting"])
            max_lag = max(max_lag, s["clock_lag_seconds"])
        s1 = await sim_state(session, url, token)
        cpu1, tok1, w1 = cpu_seconds(proc.pid), stats.tokens, time.monotonic()
        await asyncio.gather(*workers)
    wall = w1 - w0
    busy_sim = s1["busy_simulated_seconds"] - s0["busy_simulated_seconds"]
    busy_wall = s1["busy_wall_seconds"] - s0["busy_wall_seconds"]
    lag_pct = 100.0 * (busy_wall - busy_sim) / busy_sim if busy_sim else float("nan")
    cpu = cpu1 - cpu0
    steps = s1["steps"] - s0["steps"]
    ttfts = sorted(stats.ttfts)
    settings = "defaults" if args.sim_defaults else f"--max-num-seqs {args.max_num_seqs}"
    print(f"simulator settings      : {settings} {' '.join(args.sim_args)}".rstrip())
    print(f"concurrency             : {args.concurrency} streams, {wall:.1f} s measured")
    print(f"peak running / waiting  : {peak_running} / {peak_waiting}")
    print(f"simulated busy time     : {busy_sim:.3f} s")
    print(f"wall time for its steps : {busy_wall:.3f} s")
    print(f"clock lag               : {lag_pct:+.2f} %  (max instantaneous {max_lag * 1e3:.1f} ms)")
    print(f"sim CPU                 : {cpu:.2f} s = {100 * cpu / wall:.0f} % of one core")
    print(f"tokens/s (client)       : {(tok1 - tok0) / wall:,.0f}")
    mean_step_ms = 1e3 * busy_sim / max(steps, 1)
    print(f"steps/s                 : {steps / wall:.1f}  (mean step {mean_step_ms:.1f} ms)")
    if ttfts:
        p50 = statistics.median(ttfts)
        p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
        print(f"client TTFB p50 / p99   : {p50 * 1e3:.0f} / {p99 * 1e3:.0f} ms")
    print(f"requests done / failed  : {stats.completed} / {stats.failed}")
    queries = s1["prefix_cache_queries"] - s0["prefix_cache_queries"]
    hits = s1["prefix_cache_hits"] - s0["prefix_cache_hits"]
    print(f"preemptions             : {s1['num_preemptions'] - s0['num_preemptions']}")
    print(f"prefix cache hit rate   : {100 * hits / max(queries, 1):.0f} % of prompt tokens")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--concurrency", type=int, default=1000, help="streams kept in flight")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--prompt-words", type=int, default=100, help="prompt tokens per request")
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--kv-blocks", type=int, default=20000, help="--num-gpu-blocks-override")
    p.add_argument(
        "--sim-defaults", action="store_true", help="run the simulator with default settings"
    )
    p.add_argument("sim_args", nargs="*", help="extra simulator options (after --)")
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(bench(args))
    return int(uvloop.run(bench(args)))


if __name__ == "__main__":
    raise SystemExit(main())
