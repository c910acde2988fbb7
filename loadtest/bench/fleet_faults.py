"""What the admin API does, and how soon, when the fleet's Redis is in trouble.

One simulator and ``--replicas`` gateway processes (default 3) on a ``redis-server`` of this
run's own (never the machine's), with the fleet's defaults (``report_interval`` 2 s,
``log_timeout`` 2 s, ``view_timeout`` 1 s) unless ``--report-interval`` says otherwise.
``--rounds`` times (default 5):

- **paused** (SIGSTOP): an admin change with an ``Idempotency-Key`` is sent; printed: how long
  its answer took and what it was (202 ``unknown`` or 503: never "nothing changed" when it may
  have), how long ``GET /admin/replicas`` took (200, marked stale); then Redis resumed, how long
  until every replica tells the change's fate.
- **restarted empty**: Redis killed and started again without its data; printed: from the
  moment it answers again, how long until each replica flags the lost log (its
  ``llm_gateway_fleet_log_losses_total`` counts it), until an admin change is taken again (the
  log healed), and whether every replica kept the state it had.

Run: ``python -m loadtest.bench.fleet_faults``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import redis

from loadtest import procs

TOKEN: Final = "bench-faults"
HEADERS: Final = {"Authorization": f"Bearer {TOKEN}"}
POLL_S: Final = 0.02


def _config(sim: str, redis_url: str, *, port: int, admin: int, name: str, report: float) -> str:
    return "\n".join(
        [
            f"port = {port}",
            f'backends = ["{sim}"]',
            'log_level = "warning"',
            'log_format = "json"',
            f'admin = {{ token = "{TOKEN}", port = {admin} }}',
            f'limits = {{ redis = {{ url = "{redis_url}", key_prefix = "bench:" }} }}',
            f'fleet = {{ log = "redis", replica = "{name}", report_interval = {report}, '
            f"report_ttl = {report * 3} }}",
        ]
    )


def _ping(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=0.2, socket_connect_timeout=0.2)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


async def _until(check: Any, within: float = 60.0) -> float:
    """Seconds until ``check()`` (awaited) is true."""
    t0 = time.perf_counter()
    while not await check():
        if time.perf_counter() - t0 > within:
            raise TimeoutError("not within the bench's bound")
        await asyncio.sleep(POLL_S)  # sleep-ok: the bench's polling interval
    return time.perf_counter() - t0


async def _losses(s: aiohttp.ClientSession, url: str) -> float:
    async with s.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("llm_gateway_fleet_log_losses_total "):
                return float(line.split()[1])
    return 0.0


async def _draining(s: aiohttp.ClientSession, admins: list[str]) -> list[dict[str, bool]]:
    out = []
    for a in admins:
        async with s.get(a + "/admin/backends", headers=HEADERS) as r:
            out.append({b["id"]: b["draining"] for b in (await r.json())["backends"]})
    return out


def _row(name: str, xs: list[float]) -> str:
    ms = sorted(x * 1000 for x in xs)
    return f"| {name} | {statistics.median(ms):.0f} | {ms[-1]:.0f} |"


@dataclass
class Bench:
    """The fleet under test and what was measured."""

    s: aiohttp.ClientSession
    urls: list[str]
    admins: list[str]
    backend: str
    store: procs.Proc
    port: int
    logs: Path
    figures: dict[str, list[float]] = field(default_factory=dict)
    answers: list[str] = field(default_factory=list)
    kept: int = 0

    def took(self, name: str, since: float) -> None:
        self.figures.setdefault(name, []).append(time.perf_counter() - since)

    async def fate_everywhere(self, key: str, *, applied: bool) -> bool:
        for a in self.admins:
            async with self.s.get(f"{a}/admin/changes/{key}", headers=HEADERS) as r:
                doc = await r.json()
            if applied and not doc["applied_here"]:
                return False
            if doc["state"] not in ("applied", "not_applied"):
                return False
        return True

    async def paused(self, n: int) -> None:
        key = f"paused-{n}-{uuid.uuid4().hex[:6]}"
        verb = "drain" if n % 2 == 0 else "undrain"
        url = f"{self.admins[n % len(self.admins)]}/admin/backends/{self.backend}/{verb}"
        os.kill(self.store.popen.pid, signal.SIGSTOP)
        t0 = time.perf_counter()
        async with self.s.post(url, headers={**HEADERS, "Idempotency-Key": key}) as r:
            doc = await r.json()
            state = doc.get("state") or doc.get("error", {}).get("code", "?")
            self.answers.append(f"{r.status} {state}")
        self.took("paused: a change answered", t0)
        t0 = time.perf_counter()
        async with self.s.get(self.admins[0] + "/admin/replicas", headers=HEADERS) as r:
            stale = r.status == 200 and "stale" in await r.json()
        self.took("paused: /admin/replicas answered (stale)", t0)
        assert stale
        os.kill(self.store.popen.pid, signal.SIGCONT)
        t0 = time.perf_counter()
        await _until(lambda: self.fate_everywhere(key, applied=False))
        self.took("resumed: its fate known everywhere", t0)

    async def empty(self) -> None:
        before = await _draining(self.s, self.admins)
        counts = [await _losses(self.s, u) for u in self.urls]
        self.store.stop()
        self.store = procs.start_redis(self.port, self.logs)
        redis_url = f"redis://127.0.0.1:{self.port}/0"
        await _until(lambda: asyncio.to_thread(_ping, redis_url))
        t0 = time.perf_counter()
        for u, count in zip(self.urls, counts, strict=True):

            async def lost(u: str = u, count: float = count) -> bool:
                return await _losses(self.s, u) > count

            await _until(lost)
        self.took("empty: flagged by every replica", t0)
        change = f"{self.admins[0]}/admin/backends/{self.backend}/drain"
        key = f"healed-{uuid.uuid4().hex[:8]}"

        async def taken() -> bool:
            async with self.s.post(change, headers={**HEADERS, "Idempotency-Key": key}) as r:
                return r.status != 503

        await _until(taken)
        self.took("empty: a change taken again (healed)", t0)
        await _until(lambda: self.fate_everywhere(key, applied=True))
        self.took("empty: that change applied everywhere", t0)
        after = await _draining(self.s, self.admins)
        self.kept += all(a == {**b, self.backend: True} for a, b in zip(after, before, strict=True))
        undrain = f"{self.admins[0]}/admin/backends/{self.backend}/undrain"
        async with self.s.post(undrain, headers=HEADERS) as r:
            await r.read()


async def run(replicas: int, rounds: int, report: float, keep: Path | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        logs = keep or Path(tmp)
        port = procs.free_port()
        redis_url = f"redis://127.0.0.1:{port}/0"
        store = procs.start_redis(port, logs)
        sim = procs.start_sim("sim", [], logs)
        gateways: list[procs.Proc] = []
        urls, admins = [], []
        bench: Bench | None = None
        try:
            sim_url = await procs.wait_sim_url(sim)
            for i in range(replicas):
                gport, admin = procs.free_ports(2)
                path = logs / f"r{i}.toml"
                conf = _config(
                    sim_url, redis_url, port=gport, admin=admin, name=f"r{i}", report=report
                )
                path.write_text(conf)
                urls.append(f"http://127.0.0.1:{gport}")
                admins.append(f"http://127.0.0.1:{admin}")
                gateways.append(procs.start_gateway_with_config(path, urls[-1], logs, name=f"r{i}"))
            for g in gateways:
                await procs.wait_ok(g, "/ready")
            async with aiohttp.ClientSession() as s:
                bench = Bench(s, urls, admins, sim_url.split("://", 1)[1], store, port, logs)
                for n in range(rounds):
                    await bench.paused(n)
                    await bench.empty()
            print(
                f"{rounds} rounds, {replicas} replicas, report_interval {report:g} s, "
                "a redis-server of the bench's own"
            )
            print("| | p50 ms | max ms |")
            print("| --- | ---: | ---: |")
            for name, xs in bench.figures.items():
                print(_row(name, xs))
            print(f"answers while paused: {', '.join(bench.answers)}")
            print(f"state kept through the empty restart on every replica: {bench.kept}/{rounds}")
        finally:
            procs.stop_all([*gateways, sim, bench.store if bench is not None else store])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--report-interval", type=float, default=2.0)
    parser.add_argument("--logs", type=Path, help="keep the processes' logs here")
    args = parser.parse_args()
    asyncio.run(run(args.replicas, args.rounds, args.report_interval, args.logs))


if __name__ == "__main__":
    main()
