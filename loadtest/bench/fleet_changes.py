"""How long an admin change takes to reach every replica of a fleet.

One simulator and ``--replicas`` gateway processes (default 3) sharing a Redis (default the
machine's, under a key prefix of this run's, deleted at the end). ``--changes`` drains and
undrains (default 60), each made through the next replica in turn, one after the other. For
each, the admin answer comes once every replica reported the change applied (or after
``fleet.wait``, 1 s): its latency is the time for a change to reach every replica, plus at most
one 20 ms read of the registry. Printed: p50, p90, p99 and the maximum, and how many answers
said every replica had applied it.

Run: ``python -m loadtest.bench.fleet_changes``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Final

import aiohttp
import redis

from loadtest import procs

TOKEN: Final = "bench-fleet"


def _config(sim: str, redis_url: str, prefix: str, *, port: int, admin: int, name: str) -> str:
    return "\n".join(
        [
            f"port = {port}",
            f'backends = ["{sim}"]',
            'log_level = "warning"',
            f'admin = {{ token = "{TOKEN}", port = {admin} }}',
            f'limits = {{ redis = {{ url = "{redis_url}", key_prefix = "{prefix}" }} }}',
            f'fleet = {{ log = "redis", replica = "{name}" }}',
        ]
    )


def _quantile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(replicas: int, changes: int, redis_url: str) -> None:
    prefix = f"bench-fleet:{uuid.uuid4().hex}:"
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        sim = procs.start_sim("sim", [], logs)
        gateways: list[procs.Proc] = []
        try:
            sim_url = await procs.wait_sim_url(sim)
            admins = []
            for i in range(replicas):
                port, admin = procs.free_ports(2)
                path = logs / f"r{i}.toml"
                path.write_text(
                    _config(sim_url, redis_url, prefix, port=port, admin=admin, name=f"r{i}")
                )
                url = f"http://127.0.0.1:{port}"
                gateways.append(procs.start_gateway_with_config(path, url, logs, name=f"r{i}"))
                admins.append(f"http://127.0.0.1:{admin}")
            for g in gateways:
                await procs.wait_ok(g, "/ready")
            backend = sim_url.split("://", 1)[1]
            latencies: list[float] = []
            everywhere = 0
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with aiohttp.ClientSession() as s:
                for i in range(changes):
                    verb = "drain" if i % 2 == 0 else "undrain"
                    url = f"{admins[i % replicas]}/admin/backends/{backend}/{verb}"
                    t0 = time.perf_counter()
                    async with s.post(url, headers=headers) as r:
                        await r.read()
                        spread = r.headers.get("X-Gateway-Replicas", "")
                        assert r.status == 200, (r.status, await r.text())
                    latencies.append(time.perf_counter() - t0)
                    everywhere += spread == f"{replicas}/{replicas}"
            ms = [x * 1000 for x in latencies]
            print(f"{changes} changes through {replicas} replicas, each answered once applied")
            print("| p50 ms | p90 ms | p99 ms | max ms | mean ms | answered n/n |")
            print("| ---: | ---: | ---: | ---: | ---: | ---: |")
            print(
                f"| {_quantile(ms, 0.5):.1f} | {_quantile(ms, 0.9):.1f} | "
                f"{_quantile(ms, 0.99):.1f} | {max(ms):.1f} | {statistics.mean(ms):.1f} | "
                f"{everywhere}/{changes} |"
            )
        finally:
            procs.stop_all([*gateways, sim])
            client = redis.Redis.from_url(redis_url)
            keys = list(client.scan_iter(match=prefix + "*"))
            if keys:
                client.delete(*keys)
            client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--changes", type=int, default=60)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    asyncio.run(run(args.replicas, args.changes, args.redis))


if __name__ == "__main__":
    main()
