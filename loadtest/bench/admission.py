"""What a rate-limit admission costs per request, for each limit store.

For the in-memory store and the Redis store (``--redis-url``, loopback by default), times
``admit`` followed by ``release`` (what every request pays), and ``admit`` + ``settle`` +
``release`` (a request whose usage is settled), one request at a time, then the same with
``--concurrency`` requests in flight (per-request latency as each caller sees it). Limits are
set high enough that every request is admitted, so the full check-and-update path runs.

Run: ``.venv/bin/python -m loadtest.bench.admission`` (``--requests 10000``). The Redis keys
go under a fresh prefix and are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from redis.asyncio import Redis

from gateway.limits.memory import MemoryLimitStore
from gateway.limits.redis_store import RedisLimitStore
from gateway.limits.store import Limits, LimitStore

LIMITS = Limits(requests_per_minute=10**9, tokens_per_minute=10**12, max_concurrent=10**6)


@dataclass(frozen=True, slots=True)
class Result:
    store: str
    work: str
    concurrency: int
    samples_us: list[float]
    wall_s: float

    def row(self) -> str:
        s = sorted(self.samples_us)
        p50 = statistics.median(s)
        p99 = s[min(len(s) - 1, int(len(s) * 0.99))]
        rate = len(s) / self.wall_s
        return (
            f"{self.store:<7} {self.work:<22} {self.concurrency:>5} {len(s):>8} "
            f"{p50:>9.1f} {p99:>9.1f} {rate:>11,.0f}"
        )


def admit_release(store: LimitStore, key: str) -> Callable[[], Awaitable[None]]:
    async def once() -> None:
        d = await store.admit(key, LIMITS, 500)
        assert d.ticket is not None
        assert d.allowed
        assert not d.degraded
        await store.release(d.ticket)

    return once


def admit_settle_release(store: LimitStore, key: str) -> Callable[[], Awaitable[None]]:
    async def once() -> None:
        d = await store.admit(key, LIMITS, 500)
        assert d.ticket is not None
        assert d.allowed
        assert not d.degraded
        await store.settle(d.ticket, 320)
        await store.release(d.ticket)

    return once


WORK: list[tuple[str, Callable[[LimitStore, str], Callable[[], Awaitable[None]]]]] = [
    ("admit+release", admit_release),
    ("admit+settle+release", admit_settle_release),
]


def redis_ping(client: Redis) -> Callable[[], Awaitable[None]]:
    """The floor: one round trip of the client library, no script."""

    async def once() -> None:
        await client.ping()

    return once


async def measure(
    op: Callable[[], Awaitable[None]], n: int, concurrency: int
) -> tuple[list[float], float]:
    samples: list[float] = []
    per_worker = n // concurrency

    async def worker() -> None:
        for _ in range(per_worker):
            t0 = time.perf_counter_ns()
            await op()
            samples.append((time.perf_counter_ns() - t0) / 1000)

    for _ in range(min(200, n)):  # warm-up: connections, script cache
        await op()
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, time.perf_counter() - started


async def run(args: argparse.Namespace) -> list[Result]:
    prefix = f"bench-admission:{uuid.uuid4().hex}:"
    stores: list[tuple[str, LimitStore]] = [("memory", MemoryLimitStore())]
    redis_client = Redis.from_url(args.redis_url, socket_timeout=1.0)
    try:
        await redis_client.ping()
    except Exception as exc:  # report and go on with the memory store
        print(f"redis at {args.redis_url} unavailable ({exc}); measuring memory only")
    else:
        stores.append(
            ("redis", RedisLimitStore(redis_client, key_prefix=prefix, timeout=args.timeout))
        )
    results: list[Result] = []
    try:
        if len(stores) > 1:
            for conc in sorted({1, args.concurrency}):
                samples, wall = await measure(redis_ping(redis_client), args.requests, conc)
                results.append(Result("redis", "PING (baseline)", conc, samples, wall))
        for name, store in stores:
            for work, make in WORK:
                for conc in sorted({1, args.concurrency}):
                    samples, wall = await measure(
                        make(store, f"{work}-{conc}"), args.requests, conc
                    )
                    results.append(Result(name, work, conc, samples, wall))
    finally:
        keys = [k async for k in redis_client.scan_iter(match=prefix + "*", count=1000)]
        if keys:
            await redis_client.delete(*keys)
        await redis_client.aclose()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--requests", type=int, default=10000, help="measured requests per case")
    p.add_argument("--concurrency", type=int, default=32, help="in-flight callers, second run")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--timeout", type=float, default=0.5, help="Redis call timeout (s)")
    p.add_argument("--no-uvloop", action="store_true", help="use asyncio's default loop")
    args = p.parse_args()
    runner: Callable[..., object] = asyncio.run
    if not args.no_uvloop:
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            pass
    results: list[Result] = runner(run(args))  # type: ignore[assignment]
    print(f"{'store':<7} {'work per request':<22} {'conc':>5} {'n':>8} {'p50 µs':>9} "
          f"{'p99 µs':>9} {'requests/s':>11}")  # fmt: skip
    for r in results:
        print(r.row())


if __name__ == "__main__":
    main()
