"""``llm-gateway loadtest pool``: several runs of one scenario as one sample.

One run's TTFT p99 is its few slowest requests (the fifth of 500), which moves more from run to
run than policies differ; pooling the runs' requests gives a p99 of many more. Reads the
``ttft_ms`` each run's ``result.json`` keeps, per label (the policy), and prints per label the
runs, requests, pooled p50/p99/max, each run's own p99, and the pooled p99 as a ratio of a
baseline label's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.stats import percentile


@dataclass
class Pooled:
    label: str
    ttft_ms: list[float] = field(default_factory=list)
    run_p99s: list[float] = field(default_factory=list)

    @property
    def p50(self) -> float:
        return percentile(sorted(self.ttft_ms), 50)

    @property
    def p99(self) -> float:
        return percentile(sorted(self.ttft_ms), 99)


class PoolError(ValueError):
    """A file that is not a loadtest result, or holds no per-request TTFTs."""


def pool(paths: Sequence[Path]) -> dict[str, Pooled]:
    """Each label's requests over every result file, in the order labels first appear."""
    out: dict[str, Pooled] = {}
    for path in paths:
        try:
            doc = json.loads(path.read_text())
            runs = doc["runs"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PoolError(f"{path}: not a loadtest result.json ({exc})") from None
        for run in runs:
            values = run.get("ttft_ms")
            if values is None:
                raise PoolError(f"{path}: run {run.get('label')!r} keeps no ttft_ms (older run)")
            p = out.setdefault(run["label"], Pooled(run["label"]))
            p.ttft_ms.extend(float(v) for v in values)
            p.run_p99s.append(percentile(sorted(values), 99))
    return out


def table(pooled: dict[str, Pooled], baseline: str | None) -> str:
    base = pooled.get(baseline) if baseline else None
    lines = [
        "| label | runs | requests | TTFT p50 | TTFT p99 | max | p99 of each run | p99 ratio |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for p in pooled.values():
        ratio = f"{p.p99 / base.p99:.2f}" if base is not None and base.p99 > 0 else "-"
        each = ", ".join(f"{v:.0f}" for v in p.run_p99s)
        lines.append(
            f"| {p.label} | {len(p.run_p99s)} | {len(p.ttft_ms)} | {p.p50:.1f} | {p.p99:.1f} "
            f"| {max(p.ttft_ms, default=float('nan')):.1f} | {each} | {ratio} |"
        )
    return "\n".join(lines)
