"""The plots of ``loadtest.bench.overload``, drawn from the cases' JSON files.

``overload.png``: per case (side by side), per class and 5-s window, the attempts sent and the
TTFT p99 of the answered ones against the interactive class's SLO (by send time), the refusals
(429 at once, 503 after waiting in the queue; by the time they came).
``budget.png`` (when ``backend-killed`` ran): the extra attempts over the budget's sliding
window against what it allows, and the load the clients offered against what reached the
engines.

Run again on a run's folder: ``python -m loadtest.bench.overload_plot DIR``.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any, Final

COLOURS: Final = {"interactive": "tab:red", "standard": "tab:blue", "batch": "tab:gray"}
ORDER: Final = ("priorities", "no-priorities", "backend-killed")


def _load(out: Path) -> list[dict[str, Any]]:
    return [
        json.loads((out / f"{name}.json").read_text())
        for name in ORDER
        if (out / f"{name}.json").exists()
    ]


def _per_second(times: list[float], start: float, end: float) -> tuple[list[float], list[int]]:
    n = max(1, math.ceil(end - start))
    counts = [0] * n
    for t in times:
        i = math.floor(t - start)
        if 0 <= i < n:
            counts[i] += 1
    return [start + i + 0.5 for i in range(n)], counts


def plot_overload(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(results), figsize=(6 * len(results), 9), squeeze=False,
                             sharex=True)  # fmt: skip
    for col, res in enumerate(results):
        sent, ttft, refused = (axes[row][col] for row in range(3))
        for cls, windows in res["timeline"].items():
            ts = [w["t"] + 2.5 for w in windows]
            colour = COLOURS.get(cls)
            sent.plot(ts, [w["sent"] / 5 for w in windows], color=colour, label=cls)
            p99 = [math.nan if w["ttft_p99_ms"] is None else w["ttft_p99_ms"] / 1e3
                   for w in windows]  # fmt: skip
            ttft.plot(ts, p99, color=colour, marker=".", label=cls)
            refused.plot(ts, [w["refused_429"] for w in windows], color=colour, label=f"{cls} 429")
            refused.plot(ts, [w["refused_503"] for w in windows], color=colour, ls="--",
                         label=f"{cls} 503 (after its wait)")  # fmt: skip
        ttft.axhline(res["settings"]["slo_ttft_p99_s"], color="tab:red", ls="--", lw=0.8,
                     label="interactive SLO")  # fmt: skip
        ttft.set_yscale("log")
        sent.set_title(f"{res['case']}: {res['rate_rps']:g} req/s for "
                       f"{res['settings']['overload_s']:g} s", fontsize=10)  # fmt: skip
        sent.set_ylabel("attempts sent / s")
        ttft.set_ylabel("TTFT p99 per 5 s (s)")
        refused.set_ylabel("refused per 5 s, when refused")
        refused.set_xlabel("seconds since the overload began (sent: by send time)")
        for ax in (sent, ttft, refused):
            ax.grid(alpha=0.3)
            ax.axvspan(0, res["settings"]["overload_s"], color="orange", alpha=0.06)
            if res.get("killed_at") is not None:
                ax.axvline(res["killed_at"], color="black", ls=":", label="engine killed")
        sent.legend(loc="upper right", fontsize=8)
        ttft.legend(loc="upper right", fontsize=8)
        refused.legend(loc="upper right", fontsize=7)
    for row in (0, 1, 2):
        lo = min(ax.get_ylim()[0] for ax in axes[row])
        hi = max(ax.get_ylim()[1] for ax in axes[row])
        for ax in axes[row]:
            ax.set_ylim(lo, hi)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_budget(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, low) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    w = res["budget_windows"]
    ts = [x["t"] for x in w]
    top.plot(ts, [x["allowed"] for x in w], color="gray", ls="--", label="the budget allows")
    top.plot(ts, [x["extra"] for x in w], color="tab:red", label="extra attempts at the engines")
    samples = res["samples"]
    window = res["settings"]["budget"]["window"]
    by_t = [s["t"] for s in samples]

    def over_window(key: str) -> list[float]:
        out = []
        for s in samples:
            j = max(i for i, t in enumerate(by_t) if t <= max(s["t"] - window, by_t[0]))
            out.append(sum(s["budget"].get(k, 0.0) - samples[j]["budget"].get(k, 0.0)
                           for k in s["budget"] if k.endswith(key)))  # fmt: skip
        return out

    top.plot(by_t, over_window("_taken"), color="tab:green", label="taken (gateway)")
    top.plot(by_t, over_window("_refused"), color="black", ls=":", label="refused (gateway)")
    top.set_ylabel(f"attempts over {window:g} s")
    top.legend(loc="upper right", fontsize=8)
    attempts = [a[0] for r in res["requests"] for a in r[3]]
    end = max(by_t, default=0.0)
    xs, offered = _per_second(attempts, by_t[0] if by_t else 0.0, end)
    low.plot(xs, offered, color="tab:purple", lw=1.2, label="offered by the clients (attempts/s)")
    names = list(samples[0]["engines"]) if samples else []
    for name, colour in zip(
        names, ("tab:orange", "tab:green", "tab:brown", "tab:pink"), strict=False
    ):
        got = [s["engines"][name]["received"] for s in samples]
        rate = [b - a for a, b in itertools.pairwise(got)]
        low.plot(by_t[1:], rate, lw=0.7, color=colour, label=f"received by {name} (/s)")
    total = [sum(e["received"] for e in s["engines"].values()) for s in samples]
    low.plot(by_t[1:], [b - a for a, b in itertools.pairwise(total)], color="black",
             label="received by the engines (/s)")  # fmt: skip
    low.set_ylabel("requests / s")
    low.set_xlabel("seconds since the overload began")
    low.legend(loc="upper right", fontsize=8)
    for ax in (top, low):
        ax.grid(alpha=0.3)
        if res.get("killed_at") is not None:
            ax.axvline(res["killed_at"], color="black", ls=":")
    top.set_title(f"{res['case']}: the retry budget ({res['settings']['budget']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_all(out: Path) -> None:
    results = _load(out)
    if results:
        plot_overload(results, out / "overload.png")
    killed = [r for r in results if r["case"] == "backend-killed"]
    if killed:
        plot_budget(killed[0], out / "budget.png")


if __name__ == "__main__":
    plot_all(Path(sys.argv[1]))
