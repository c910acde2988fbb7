"""A compressed day's run as it is reported (``loadtest.bench.capacity``): its requests, its
figures (engine-seconds, TTFT per window, failures), its JSON, its summary line and its plot."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from loadtest.day import integral, windows
from loadtest.stats import percentile


@dataclass(slots=True)
class Sent:
    at: float  # seconds from the day's start (negative: the warm-up)
    prompt_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    status: int = 0
    error: str | None = None


REQUEST_COLUMNS: Final = ("at", "ttft", "e2e", "status", "error", "prompt_tokens")


def rows(requests: list[Sent]) -> list[list[Any]]:
    """Each request as a row of ``REQUEST_COLUMNS``, times to 0.1 ms."""

    def ms(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return [
        [ms(r.at), ms(r.ttft), ms(r.e2e), r.status, r.error, r.prompt_tokens]
        for r in sorted(requests, key=lambda r: r.at)
    ]


def dump(result: dict[str, Any]) -> str:
    """The result as JSON, a sample, a request row or a log line a line (diffs and sizes stay
    readable)."""

    def one_a_line(items: list[Any], indent: str) -> str:
        inner = f",\n{indent} ".join(json.dumps(x, separators=(",", ":")) for x in items)
        return f"[\n{indent} {inner}\n{indent}]"

    parts = []
    for key, value in result.items():
        if key in ("samples", "events"):
            text = one_a_line(value, " ")
        elif key == "requests":
            body = one_a_line(value["rows"], "  ")
            text = f'{{\n  "columns": {json.dumps(value["columns"])},\n  "rows": {body}\n }}'
        else:
            text = json.dumps(value, indent=1).replace("\n", "\n ")
        parts.append(f" {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def figures(
    samples: list[dict[str, Any]],
    requests: list[Sent],
    *,
    width: float,
    end: float,
    engines: int,
    slo: float,
) -> dict[str, Any]:
    """The day's figures, from 0 to ``end`` (the warm-up left out): engine-seconds (always on:
    ``engines`` x ``end``), TTFT per window of ``width`` seconds against ``slo``, failures."""
    day = [r for r in requests if 0 <= r.at < end]
    always_on = engines * end

    def seconds(key: Any) -> float:
        return integral([(s["t"], float(key(s))) for s in samples if s["t"] >= 0], 0.0, end)

    awake = seconds(lambda s: s["awake"])
    awake_gw = seconds(lambda s: s["gateway"]["awake"])
    not_asleep = seconds(lambda s: max(s["awake"], 0) + s["moving"])
    ws = windows([(r.at, r.ttft, r.error is None) for r in day], width, 0.0, end)
    ttfts = sorted(r.ttft for r in day if r.error is None and r.ttft is not None)
    return {
        "day_s": end,
        "always_on_engine_s": always_on,
        "awake_engine_s": round(awake, 1),
        "awake_share": round(awake / always_on, 4),
        "awake_engine_s_gateway": round(awake_gw, 1),
        "awake_or_moving_engine_s": round(not_asleep, 1),
        "requests": len(day),
        "failed": sum(1 for r in day if r.error is not None),
        "errors": dict(Counter(r.error for r in day if r.error is not None)),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "windows": [asdict(w) for w in ws],
        "windows_over_slo": sum(1 for w in ws if not w.within(slo)),
        "worst_window_p99": max((w.ttft_p99 for w in ws if not math.isnan(w.ttft_p99)), default=0),
    }


def summary(result: dict[str, Any]) -> str:
    f = result["figures"]
    held = sum(result["holds"].values())
    decisions = ", ".join(f"{k} {v:g}" for k, v in sorted(result["decisions"].items()))
    ms = {k: f[k] * 1000 for k in ("ttft_p50", "ttft_p99", "worst_window_p99")}
    return (
        f"{result['case']}: awake {f['awake_engine_s']:.0f} engine-s of"
        f" {f['always_on_engine_s']:.0f} ({f['awake_share']:.1%}); TTFT p50"
        f" {ms['ttft_p50']:.0f} ms, p99 {ms['ttft_p99']:.0f} ms, worst window p99"
        f" {ms['worst_window_p99']:.0f} ms, {f['windows_over_slo']} windows over"
        f" {result['slo_s']:g} s;"
        f" {f['requests']} requests, {f['failed']} failed; held {held:g};"
        f" decisions: {decisions or 'none'}"
    )


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(results), figsize=(6.5 * len(results), 8), squeeze=False)
    for col, result in enumerate(results):
        samples = [s for s in result["samples"] if s["t"] >= 0]
        f = result["figures"]
        ts = [s["t"] for s in samples]
        demand, engines, ttft = axes[0][col], axes[1][col], axes[2][col]
        demand.plot(ts, [s["rate"] for s in samples], color="gray", ls="--", label="rate asked")
        demand.plot(ts, [s["sent"] for s in samples], color="tab:blue", lw=0.8, label="sent/s")
        demand.plot(ts, [s["in_flight"] for s in samples], color="tab:orange", label="in flight")
        demand.set_ylabel("requests")
        demand.legend(loc="upper left", fontsize=8)
        demand.set_title(
            f"{result['case']}: awake {f['awake_share']:.0%} of always-on, "
            f"{f['failed']} failed, {f['windows_over_slo']} windows over SLO",
            fontsize=10,
        )
        engines.step(ts, [s["awake"] for s in samples], where="post", color="tab:green",
                     label="awake (/is_sleeping)")  # fmt: skip
        engines.step(ts, [s["gateway"]["awake"] for s in samples], where="post",
                     color="black", ls=":", label="awake (gateway)")  # fmt: skip
        if any(s["needed"] for s in samples):
            engines.step(ts, [s["needed"] or 0 for s in samples], where="post",
                         color="tab:purple", lw=0.6, alpha=0.5, label="needed")  # fmt: skip
        engines.set_ylim(-0.2, result["engines"] + 0.5)
        engines.set_ylabel("engines")
        engines.legend(loc="upper left", fontsize=8)
        ws = f["windows"]
        mids = [(w["start"] + w["end"]) / 2 for w in ws]
        ttft.plot(mids, [w["ttft_p99"] * 1000 for w in ws], marker="o", ms=3, color="tab:red",
                  label="TTFT p99")  # fmt: skip
        ttft.plot(mids, [w["ttft_p50"] * 1000 for w in ws], marker=".", color="tab:pink",
                  label="TTFT p50")  # fmt: skip
        ttft.axhline(result["slo_s"] * 1000, color="gray", ls="--", label="SLO (p99)")
        ttft.set_ylabel("TTFT ms, per window")
        ttft.set_xlabel("seconds into the day")
        ttft.legend(loc="upper left", fontsize=8)
        for ax in (demand, engines, ttft):
            ax.grid(alpha=0.3)
            ax.set_xlim(0, result["day"][-1][0])
    top = max(ax.get_ylim()[1] for ax in axes[2])
    for ax in axes[2]:
        ax.set_ylim(0, top)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
