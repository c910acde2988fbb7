"""Progressive rollouts on the simulator, each case of issue 43 with its figures over time.

Cases (``--cases``, default every one):

- ``healthy``: the canary as fast and as right as stable: promoted through every step;
- ``slow``: the canary at twice the simulator's step cost (``--slowdown 2``: twice the TTFT):
  rolled back by the TTFT gate;
- ``errors``: 5 % of the canary's requests answered 500: rolled back by the error gate;
- ``different``: the canary's answers from another seed (as fast, no error): rolled back by
  the probes (three prompts sent to both pools once a step, compared token by token);
- ``failover``: the replica driving the rollout SIGKILLed after the first step: another
  finishes it, every step made once.

Each case: two simulators in the pool ``stable``, one in ``canary``, both serving ``m``
behind the alias ``chat`` (stable 100 %); ``--replicas`` gateway processes (3 for failover)
sharing the machine's Redis under a key prefix of the run's; a closed loop of
``--concurrency`` streams (16 tokens) spread over the replicas; the rollout started with
``PLAN``. Every 0.5 s the run records the canary's share, the rollout's status and step, who
drives it and the gates' figures as the driver sees them. It ends when the rollout does (or
after ``--timeout`` s). Written to ``--out``: ``<case>.json`` (every sample, the history from the
log, the replicas' ``rollout_*`` log lines) and ``<case>.png`` (share and gates over time); a
summary line per case is printed.

Run: ``python -m loadtest.bench.rollout --out docs/bench/rollout-<date>``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import redis

from loadtest import procs

TOKEN: Final = "bench-rollout"
AUTH: Final = {"Authorization": f"Bearer {TOKEN}"}
ALIAS: Final = "chat"
PLAN: Final[dict[str, Any]] = {
    "stable": "stable",
    "canary": "canary",
    "steps": [5, 25, 50, 100],
    "hold_s": 15,
    "min_requests": 30,  # about what 5 % of this load brings in one hold
    "gates": {
        "error_margin": 0.02,
        "ttft_p99_factor": 1.5,
        "itl_p50_factor": 1.5,
        "min_agreement": 0.9,
    },
    "probes": ["Tell me about the sea.", "Count to ten.", "What is a gateway?"],
    "probe_tokens": 16,
}
CANARY_ARGS: Final = {
    "healthy": [],
    "slow": ["--slowdown", "2"],
    "errors": ["--error-rate", "0.05", "--error-status", "500"],
    "different": ["--seed", "7"],
    "failover": [],
}
SAMPLE_EVERY: Final = 0.5


@dataclass
class Case:
    name: str
    replicas: int
    samples: list[dict[str, Any]] = field(default_factory=list)
    killed_at: float | None = None
    killed: str | None = None
    t0_unix: float = 0.0  # when the rollout was started (the history's times are Unix times)


def _config(
    sims: dict[str, str], redis_url: str, prefix: str, *, ports: tuple[int, int], name: str
) -> str:
    port, admin = ports
    backends = ", ".join(f'{{ url = "{url}", name = "{n}" }}' for n, url in sims.items())
    return "\n".join(
        [
            f"port = {port}",
            f"backends = [{backends}]",
            'log_level = "info"',
            'log_format = "json"',
            f'admin = {{ token = "{TOKEN}", port = {admin} }}',
            f'limits = {{ redis = {{ url = "{redis_url}", key_prefix = "{prefix}" }} }}',
            f'fleet = {{ log = "redis", replica = "{name}", report_interval = 0.5, '
            "report_ttl = 3.0 }",
            "rollout = { drive_every = 0.25, lease_ttl = 2.0 }",
            f"aliases = {{ {ALIAS} = {{ stable = 100, canary = 0 }} }}",
            "[[pools]]",
            'name = "stable"',
            'model = "m"',
            'backends = ["s1", "s2"]',
            "[[pools]]",
            'name = "canary"',
            'model = "m"',
            'backends = ["c1"]',
        ]
    )


async def _load(urls: list[str], concurrency: int, statuses: list[int]) -> None:
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 16,
        "stream": True,
    }
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as s:

        async def one() -> None:
            while True:
                try:
                    url = random.choice(urls)
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        await r.read()
                        statuses.append(r.status)
                except (aiohttp.ClientError, OSError, TimeoutError):
                    statuses.append(0)  # a stream cut by the replica killed under it

        await asyncio.gather(*(one() for _ in range(concurrency)))


async def _sample(s: aiohttp.ClientSession, admins: dict[str, str], t0: float) -> dict[str, Any]:
    sample: dict[str, Any] = {"t": round(time.monotonic() - t0, 2)}
    for name, admin in admins.items():
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with s.get(f"{admin}/admin/rollouts/{ALIAS}", headers=AUTH) as r:
                view = await r.json()
            sample.setdefault("status", view["status"])
            sample.setdefault("step", view["step"])
            sample.setdefault("share", view["weights"].get("canary", 0.0))
            if view.get("driven_here"):
                sample["driver"] = name
                sample["now"] = view.get("now")
    return sample


@dataclass
class Started:
    all: list[procs.Proc] = field(default_factory=list)
    gateways: dict[str, procs.Proc] = field(default_factory=dict)
    admins: dict[str, str] = field(default_factory=dict)


async def _start(
    case: Case, args: argparse.Namespace, logs: Path, prefix: str, up: Started
) -> None:
    """The simulators and the replicas, each listening (``up`` fills in as they start)."""
    sims: dict[str, str] = {}
    for name, extra in (("s1", []), ("s2", []), ("c1", CANARY_ARGS[case.name])):
        p = procs.start_sim(f"{case.name}-{name}", ["--model", "m", *extra], logs)
        up.all.append(p)
        sims[name] = await procs.wait_sim_url(p)
    for i in range(case.replicas):
        name = f"r{i}"
        port, admin = procs.free_ports(2)
        path = logs / f"{case.name}-{name}.toml"
        path.write_text(_config(sims, args.redis, prefix, ports=(port, admin), name=name))
        g = procs.start_gateway_with_config(
            path, f"http://127.0.0.1:{port}", logs, name=f"{case.name}-{name}"
        )
        up.all.append(g)
        up.gateways[name] = g
        up.admins[name] = f"http://127.0.0.1:{admin}"
    for g in up.gateways.values():
        await procs.wait_ok(g, "/ready", within=60)


async def _observe(case: Case, args: argparse.Namespace, up: Started, urls: list[str]) -> Any:
    """Start the rollout, sample it until it ends (killing its driver mid-way in
    ``failover``); the history the log recorded."""
    t0 = time.monotonic()
    case.t0_unix = time.time()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        url = f"{up.admins['r0']}/admin/rollouts/{ALIAS}"
        async with s.post(url, json=PLAN, headers=AUTH) as r:
            if r.status != 200:
                raise RuntimeError(f"the rollout was refused: {r.status} {await r.text()}")
        live = dict(up.admins)
        while time.monotonic() - t0 < args.timeout:
            sample = await _sample(s, live, t0)
            case.samples.append(sample)
            if sample.get("status") in ("promoted", "aborted"):
                break
            victim = sample.get("driver")
            due = case.name == "failover" and case.killed is None and sample.get("step", 0) >= 1
            if due and victim is not None:  # the driver, once past the first step
                up.gateways[victim].popen.kill()
                case.killed, case.killed_at = str(victim), float(sample["t"])
                live.pop(victim)
                urls.remove(up.gateways[victim].url)  # as a load balancer would: no more to it
            await asyncio.sleep(SAMPLE_EVERY)  # sleep-ok: the sampling period
        for admin in live.values():
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with s.get(f"{admin}/admin/rollouts/{ALIAS}", headers=AUTH) as r:
                    return (await r.json())["history"]
    return None


def _events(gateways: dict[str, procs.Proc]) -> list[dict[str, Any]]:
    """The replicas' ``rollout_*`` log lines."""
    events = []
    for name, g in gateways.items():
        for line in g.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                if isinstance(doc, dict) and str(doc.get("event", "")).startswith("rollout_"):
                    events.append({"replica": name, **doc})
    return events


async def run_case(case: Case, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    prefix = f"bench-rollout:{uuid.uuid4().hex}:"
    up = Started()
    statuses: list[int] = []
    try:
        await _start(case, args, logs, prefix, up)
        urls = [g.url for g in up.gateways.values()]
        load = asyncio.create_task(_load(urls, args.concurrency, statuses))
        await asyncio.sleep(3)  # sleep-ok: warm-up, both pools' figures under way
        try:
            history = await _observe(case, args, up, urls)
        finally:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
    finally:
        procs.stop_all(up.all)
        client = redis.Redis.from_url(args.redis)
        try:
            for key in client.scan_iter(match=f"{prefix}*"):
                client.delete(key)
        finally:
            client.close()
    return {
        "case": case.name,
        "plan": PLAN,
        "canary_args": CANARY_ARGS[case.name],
        "replicas": case.replicas,
        "concurrency": args.concurrency,
        "killed": case.killed,
        "killed_at": case.killed_at,
        "t0_unix": case.t0_unix,
        "samples": case.samples,
        "history": history,
        "events": _events(up.gateways),
        "requests": len(statuses),
        "failed": sum(1 for x in statuses if x != 200),
    }


def summary(result: dict[str, Any]) -> str:
    samples = result["samples"]
    end = samples[-1] if samples else {}
    history = result["history"] or []
    steps = [(e["action"], e["step"]) for e in history]
    last = history[-1] if history else {}
    return (
        f"{result['case']}: {end.get('status')} at {end.get('t')} s "
        f"(hold {PLAN['hold_s']} s a step), steps {steps}, why {last.get('why')!r}, "
        f"requests {result['requests']} ({result['failed']} not 200)"
        + (f", {result['killed']} killed at {result['killed_at']} s" if result["killed"] else "")
    )


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    ts = [s["t"] for s in samples]
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    top.step(ts, [s.get("share", 0) for s in samples], where="post", color="tab:blue")
    top.set_ylabel("canary share %")
    top.set_ylim(-5, 105)
    top.set_title(summary(result).split(", steps")[0])

    def gate(name: str, key: str) -> list[float | None]:
        out: list[float | None] = []
        for s in samples:
            now = s.get("now") or {}
            got = [r for r in now.get("readings", []) if r["gate"] == name]
            out.append(got[0][key] if got and got[0][key] is not None else None)
        return out

    def drawn(values: list[float | None], scale: float) -> list[float]:
        return [float("nan") if v is None else v * scale for v in values]

    mid.plot(ts, drawn(gate("errors", "canary"), 100), label="canary", color="tab:red")
    mid.plot(ts, drawn(gate("errors", "limit"), 100), label="limit", color="gray", ls="--")
    mid.set_ylabel("errors %")
    mid.legend(loc="upper left")
    low.plot(ts, drawn(gate("ttft_p99", "canary"), 1000), label="canary p99", color="tab:red")
    low.plot(ts, drawn(gate("ttft_p99", "stable"), 1000), label="stable p99", color="tab:green")
    low.plot(ts, drawn(gate("ttft_p99", "limit"), 1000), label="limit", color="gray", ls="--")
    low.set_ylabel("TTFT ms")
    low.set_xlabel("seconds since the rollout began")
    low.legend(loc="upper left")
    agree = None
    probes = gate("probes", "canary")
    if any(p is not None for p in probes) or any(
        r["gate"] == "probes" for e in result["history"] or [] for r in e["readings"]
    ):
        agree = mid.twinx()
        agree.plot(ts, drawn(probes, 100), label="probes agree", color="tab:purple", ls="-.")
        agree.set_ylabel("probes agree %")
        agree.set_ylim(-5, 105)
        agree.legend(loc="upper right")
    marks = {"errors": (mid, 100), "ttft_p99": (low, 1000), "probes": (agree, 100)}
    # Each decision, with the figures it was made on (samples may fall between them).
    for e in result["history"] or []:
        t = e["at"] - result["t0_unix"]
        for r in e["readings"]:
            ax, scale = marks.get(r["gate"], (None, 1))
            if ax is not None and r["canary"] is not None:
                ax.scatter([t], [r["canary"] * scale], marker="x" if r["passed"] else "X",
                           color="tab:red", s=30 if r["passed"] else 80, zorder=3)  # fmt: skip
    for ax in (top, mid, low):
        ax.grid(alpha=0.3)
        if result["killed_at"] is not None:
            ax.axvline(result["killed_at"], color="black", ls=":")
    if result["killed_at"] is not None:
        top.annotate(f"{result['killed']} killed", (result["killed_at"], 50))
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


async def main_async(args: argparse.Namespace, out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases.split(","):
            replicas = 3 if name == "failover" else args.replicas
            result = await run_case(Case(name, replicas), args, Path(tmp) / name)
            (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
            plot(result, out / f"{name}.png")
            print(summary(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CANARY_ARGS))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    asyncio.run(main_async(args, out))


if __name__ == "__main__":
    main()
