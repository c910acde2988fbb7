"""TTFT p50/p99/max of each case here, every run's requests pooled; ratio of p99 to least_load's.

Run from this folder: ``python pool_cases.py``. (``llm-gateway loadtest pool`` pools by label,
and every case here is labelled ``predicted_latency``; this groups them by file name.)
"""

import glob
import json
import math


def ttfts(pattern: str, policy: str) -> list[float]:
    out: list[float] = []
    for name in sorted(glob.glob(pattern)):
        with open(name) as f:
            for run in json.load(f)["runs"]:
                if run["policy"] == policy:
                    out += run["ttft_ms"]
    return sorted(out)


def q(xs: list[float], p: float) -> float:
    return xs[max(0, math.ceil(p * len(xs)) - 1)]


for scenario in ("slowdown", "uniform", "mixed"):
    base = ttfts(f"{scenario}-*.json", "least_load")
    if not base:
        continue
    print(f"{scenario}: least_load n={len(base)} p50={q(base, .5):.1f} p99={q(base, .99):.1f} max={base[-1]:.0f}")
    for case in ("move", "hedge-f3", "hedge-f2", "hedge-f1.5", "hedge-budget"):
        xs = ttfts(f"{scenario}-{case}-*.json", "predicted_latency")
        if xs:
            print(
                f"  {case}: n={len(xs)} p50={q(xs, .5):.1f} p99={q(xs, .99):.1f} "
                f"max={xs[-1]:.0f} ratio={q(xs, .99) / q(base, .99):.2f}"
            )
