"""What latency-aware routing costs per request: a decision, and learning from its outcome.

``python -m loadtest.bench.latency`` prints, for one process on one core, at 4, 16 and 64
backends (every backend's fits trained, its load varied):

- **decision**: ``predicted_latency.choose`` (load guard, each candidate's load and predicted
  TTFT, the lowest), in µs, without prefix knowledge and with the approximate prefix index
  (a 1,000-character prompt), beside ``least_load`` for reference;
- **the attempt's share**: what every request pays under any policy (the chosen backend's
  load and prediction, its pending prefill, and learning from the outcome), in µs;
- **solving**: one backend's two fits solved again (done at most every 0.25 s per backend
  that changed), in µs.

Figures, not asserts: a benchmark, not a timed test.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from policies import (
    BackendSnapshot,
    LatencyTracker,
    Outcome,
    Policy,
    PredictionConfig,
    RouteFacts,
    make_policy,
)
from policies.latency import Load, load_of, prompt_size
from policies.prefix import PrefixHasher


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _per_call_us(fn: Callable[[], object], min_s: float) -> float:
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_s:
        for _ in range(100):
            fn()
        n += 100
    return elapsed / n * 1e6


def _trained(n: int, clock: Clock, rng: random.Random) -> LatencyTracker:
    tracker = LatencyTracker(clock=clock)
    for i in range(n * 200):
        b = f"b{i % n}"
        load = Load(rng.uniform(0, 3000), rng.randrange(4), rng.randrange(16), rng.uniform(0, 2000))
        ttft = 0.03 + 0.08 * load.uncached / 1000 + 0.05 * load.queued
        outcome = Outcome(
            ok=True, status=200, first_token_s=ttft, tokens=64, duration_s=ttft + 63 * 0.02
        )
        tracker.observe(b, load, outcome)
        clock.t += 0.01
    return tracker


def _snapshots(n: int, rng: random.Random) -> list[BackendSnapshot]:
    return [
        BackendSnapshot(
            f"b{i}",
            in_flight=rng.randrange(8),
            sent_since_scrape=rng.randrange(3),
            queue_depth=rng.randrange(4),
            running=rng.randrange(16),
        )
        for i in range(n)
    ]


def _rows(n: int, min_s: float) -> list[tuple[str, int, float]]:
    text = "You are a helpful assistant. " * 36  # about 1,000 characters
    hashes, _ = PrefixHasher().facts("m", {"prompt": text})
    rng = random.Random(n)
    clock = Clock()
    tracker = _trained(n, clock, rng)
    snaps = _snapshots(n, rng)
    facts = RouteFacts("m", prompt_chars=len(text), max_tokens=128)
    pfacts = RouteFacts("m", prefix_hashes=hashes, prompt_chars=len(text), max_tokens=128)

    def predicted(prefix: str) -> Policy:
        # balance_abs huge: the guard passes every candidate, so each one is weighed.
        cfg = PredictionConfig(prefix=prefix, balance_abs=1e9)  # type: ignore[arg-type]
        return make_policy("predicted_latency", tracker=tracker, prediction=cfg)

    least, plain, approx = make_policy("least_load"), predicted("none"), predicted("approximate")
    ok = Outcome(ok=True, status=200, first_token_s=0.05, tokens=64, duration_s=1.3)
    chosen = snaps[0]

    def attempt() -> None:
        load = load_of(chosen, prompt_size(facts), 0.0, tracker.ahead(chosen.id))
        prediction = tracker.predict(chosen.id, load)
        tracker.begin(chosen.id, load.uncached).done()
        tracker.observe(chosen.id, load, ok, prediction)

    def solve() -> None:
        clock.t += 1.0  # past resolve_s: the next prediction solves again
        tracker.predict("b1", Load(100, 0, 1))

    return [
        ("least_load choose", n, _per_call_us(lambda: least.choose(facts, snaps), min_s)),
        ("predicted_latency choose", n, _per_call_us(lambda: plain.choose(facts, snaps), min_s)),
        (
            "predicted_latency + approximate prefix choose",
            n,
            _per_call_us(lambda: approx.choose(pfacts, snaps), min_s),
        ),
        ("every attempt (predict, pending, learn)", n, _per_call_us(attempt, min_s)),
        ("solve one backend's fits and the fleet's", n, _per_call_us(solve, min_s)),
    ]


def run(min_s: float = 0.5) -> list[tuple[str, int, float]]:
    return [row for n in (4, 16, 64) for row in _rows(n, min_s)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=0.5, help="time per figure")
    args = p.parse_args(argv)
    print(f"{'what':<48} {'backends':>8} {'µs':>8}")
    for what, n, us in run(args.seconds):
        print(f"{what:<48} {n:>8} {us:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
