"""The Grafana dashboard (``deploy/grafana/llm-gateway.json``) drawn without Grafana: each
panel's queries run against a real Prometheus over a time range, plotted in the dashboard's
own layout (rows, panels, legends, units) with matplotlib.

For the README's picture where no Grafana can be installed, and for checking that every panel
shows data. ``$__rate_interval`` becomes ``rate_interval`` (Grafana's own rule: four scrape
intervals at least).

    python -m loadtest.dashboard --prometheus http://127.0.0.1:9090 --minutes 5 --out x.png
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx

DASHBOARD: Final = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "llm-gateway.json"
_UNITS: Final = {"percentunit": "%", "s": "s", "reqps": "req/s", "ops": "/s", "short": ""}


@dataclass(frozen=True, slots=True)
class Series:
    legend: str
    times: list[float]
    values: list[float]


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    kind: str  # timeseries, stat or row
    unit: str
    grid: dict[str, int]
    queries: list[tuple[str, str]]  # (expr, legend format)


def panels(dashboard: dict[str, Any]) -> list[Panel]:
    out = []
    for p in dashboard["panels"]:
        out.append(
            Panel(
                title=p["title"],
                kind=p["type"],
                unit=p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short"),
                grid=p["gridPos"],
                queries=[(t["expr"], t.get("legendFormat", "")) for t in p.get("targets", [])],
            )
        )
    return out


def expand(expr: str, rate_interval: str) -> str:
    """A panel's query as Prometheus takes it (Grafana's variables replaced)."""
    return expr.replace("$__rate_interval", rate_interval)


def legend(fmt: str, labels: dict[str, str]) -> str:
    text = fmt
    for k, v in labels.items():
        text = text.replace("{{" + k + "}}", v)
    return text or ", ".join(f"{k}={v}" for k, v in labels.items()) or "value"


def query_range(
    client: httpx.Client, expr: str, fmt: str, *, start: float, end: float, step: float
) -> list[Series]:
    r = client.get(
        "/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step}
    )
    r.raise_for_status()
    out = []
    for result in r.json()["data"]["result"]:
        points = [(float(t), float(v)) for t, v in result["values"]]
        out.append(
            Series(legend(fmt, result["metric"]), [t for t, _ in points], [v for _, v in points])
        )
    return out


def fetch(
    prometheus: str,
    dashboard: dict[str, Any],
    start: float,
    end: float,
    *,
    rate_interval: str = "20s",
) -> list[tuple[Panel, list[Series]]]:
    step = max(1.0, (end - start) / 240)
    with httpx.Client(base_url=prometheus, timeout=30) as client:
        return [
            (
                p,
                [
                    s
                    for expr, fmt in p.queries
                    for s in query_range(
                        client, expand(expr, rate_interval), fmt, start=start, end=end, step=step
                    )
                ],
            )
            for p in panels(dashboard)
        ]


def render(
    data: list[tuple[Panel, list[Series]]], out: Path, title: str, *, start: float, end: float
) -> None:
    """Draw the panels where the dashboard's grid puts them (24 columns, rows of 8 units),
    each over the whole range (``start`` to ``end``, epoch seconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bottom = max(p.grid["y"] + p.grid["h"] for p, _ in data) + 1  # a unit for the title
    fig = plt.figure(figsize=(24, bottom * 0.62))
    fig.suptitle(title, fontsize=16, x=0.01, y=0.998, ha="left", va="top")
    for panel, series in data:
        g = dict(panel.grid, y=panel.grid["y"] + 1)
        rect = (g["x"] / 24 + 0.005, 1 - (g["y"] + g["h"]) / bottom + 0.012, g["w"] / 24 - 0.012)
        height = g["h"] / bottom - 0.035
        if panel.kind == "row":
            fig.text(rect[0], 1 - g["y"] / bottom - 0.012, panel.title, fontsize=13, weight="bold")
            continue
        ax = fig.add_axes((rect[0], rect[1], rect[2], height))
        ax.set_title(panel.title, fontsize=10, loc="left")
        if panel.kind == "stat":
            last = [s.values[-1] for s in series if s.values]
            ax.axis("off")
            text = f"{last[-1]:g}" if last else "no data"
            color = "#2e7d32" if last and last[-1] >= 1 else "#c62828"
            ax.text(0.5, 0.45, text, fontsize=40, ha="center", va="center", color=color)
            continue
        scale = 100.0 if panel.unit == "percentunit" else 1.0
        for s in series[:12]:
            values = [v * scale if math.isfinite(v) else math.nan for v in s.values]
            ax.plot([(t - start) / 60 for t in s.times], values, label=s.legend[:40], lw=1.2)
        ax.set_xlim(0, (end - start) / 60)
        if not any(math.isfinite(v) for s in series for v in s.values):
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel(_UNITS.get(panel.unit, panel.unit), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=6, loc="upper left", ncol=2, framealpha=0.6)
    fig.text(0.99, 0.002, "minutes into the run", fontsize=8, ha="right")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=70)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    ap.add_argument("--minutes", type=float, default=10.0, help="the range drawn, ending now")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dashboard", type=Path, default=DASHBOARD)
    args = ap.parse_args(argv)
    dashboard = json.loads(args.dashboard.read_text())
    end = time.time()
    data = fetch(args.prometheus, dashboard, end - args.minutes * 60, end)
    title = f"{dashboard['title']} (rendered from Prometheus without Grafana)"
    render(data, args.out, title, start=end - args.minutes * 60, end=end)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
