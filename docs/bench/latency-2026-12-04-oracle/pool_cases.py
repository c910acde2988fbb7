"""TTFT p50/p99/max of each case here, every run's requests pooled; p99 against the baseline's.

Run from this folder: ``python pool_cases.py``. Percentiles take the request at the rank (as in
``../latency-2026-12-03-hedge/pool_cases.py``), each run's p99 too.
"""

import glob
import json
import math

CASES = (  # (case, files, label); the first is the baseline
    ("slow-down, `least_load` (baseline)", "baseline-least-load-*.json", "least_load"),
    ("slow-down + oracle drain, `least_load`", "oracle-*.json", "least_load"),
    ("slow-down + oracle drain, `predicted_latency`", "oracle-*.json", "predicted_latency"),
    ("uniform (never slows), `least_load`", "uniform-least-load-*.json", "least_load"),
)


def q(xs: list[float], p: float) -> float:
    return xs[max(0, math.ceil(p * len(xs)) - 1)]


def runs(pattern: str, label: str) -> list[list[float]]:
    out = []
    for name in sorted(glob.glob(pattern)):
        with open(name) as f:
            out += [sorted(r["ttft_ms"]) for r in json.load(f)["runs"] if r["label"] == label]
    return out


base_p99 = None
print("| case | runs | requests | p50 | p99 | max | p99 / baseline | p99 of each run |")
print("|---|---:|---:|---:|---:|---:|---:|---|")
for case, pattern, label in CASES:
    each = runs(pattern, label)
    xs = sorted(x for r in each for x in r)
    p99 = q(xs, 0.99)
    base_p99 = base_p99 or p99
    print(
        f"| {case} | {len(each)} | {len(xs)} | {q(xs, 0.5):.1f} | {p99:.1f} | {xs[-1]:,.0f} "
        f"| {p99 / base_p99:.2f} | {', '.join(f'{q(r, 0.99):.0f}' for r in each)} |"
    )
