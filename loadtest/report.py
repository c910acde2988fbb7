"""Results out: a rich table, a JSON file and PNG plots (several runs side by side)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from loadtest.client import RunResult
from loadtest.stats import Slo, Summary, loop_lag_warning, summarize, timeline


@dataclass(frozen=True, slots=True)
class LabeledRun:
    """One run with its name on the plots (a policy, a scenario, a URL) and its summary."""

    label: str
    result: RunResult
    summary: Summary
    extra: dict[str, Any] = field(default_factory=dict)  # server-side figures, commands...

    @classmethod
    def of(cls, label: str, result: RunResult, slo: Slo | None = None, **extra: Any) -> LabeledRun:
        return cls(label, result, summarize(result.records, slo), dict(extra))

    @property
    def warning(self) -> str | None:
        return loop_lag_warning(
            self.result.loop_lag, self.summary.ttft, client_cpu_share=self.result.client_cpu_share
        )


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:,.1f}"


def table(runs: Sequence[LabeledRun], title: str = "load test") -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("run")
    for col in (
        "ok",
        "errors",
        "req/s",
        "tok/s",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "TPOT mean",
        "E2E p50",
        "E2E p99",
        "goodput",
    ):
        t.add_column(col, justify="right")
    for r in runs:
        s = r.summary
        errors = ", ".join(f"{k} {v}" for k, v in s.errors.items()) or "0"
        goodput = "-" if s.goodput_share is None else f"{s.goodput_share:.0%}"
        t.add_row(
            r.label,
            str(s.ok),
            errors,
            f"{s.request_throughput:.2f}",
            f"{s.output_throughput:,.0f}",
            _ms(s.ttft.p50),
            _ms(s.ttft.p90),
            _ms(s.ttft.p99),
            _ms(s.itl.p50),
            _ms(s.itl.p99),
            _ms(s.tpot.mean),
            _ms(s.e2e.p50),
            _ms(s.e2e.p99),
            goodput,
        )
    t.caption = "times in ms; ITL pooled over requests; goodput = share meeting the SLOs"
    return t


def run_json(r: LabeledRun, *, bucket: float = 1.0) -> dict[str, Any]:
    res = r.result
    return {
        "label": r.label,
        "url": res.url,
        "load": res.load.describe(),
        "load_params": _plain(res.load),
        "workload": _plain(res.workload),
        "started_at": res.started_at,
        "wall_s": round(res.wall, 3),
        "unfinished": res.unfinished,
        "summary": r.summary.to_json(),
        "client": {
            "loop_lag_ms": res.loop_lag.to_json_ms(),
            "cpu_s": round(res.client_cpu, 3),
            "cpu_share": round(res.client_cpu_share, 3),
            "warning": r.warning,
        },
        "timeline": [dataclasses.asdict(b) for b in timeline(res.records, bucket)],
        # Every measured request's TTFT, so that runs can be pooled (``loadtest pool``).
        "ttft_ms": sorted(
            round(x.ttft * 1e3, 2)
            for x in res.records
            if x.ok and not x.warmup and x.ttft is not None
        ),
        **r.extra,
    }


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    return obj


def write_json(path: Path, runs: Sequence[LabeledRun], **meta: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = clean({**meta, "runs": [run_json(r) for r in runs]})
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")


def clean(obj: Any) -> Any:
    """``obj`` with NaN and infinities as None (JSON has neither)."""
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else obj
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [clean(v) for v in obj]
    return obj


def plot(runs: Sequence[LabeledRun], path: Path, title: str = "", bucket: float = 1.0) -> None:
    """One PNG, runs side by side: TTFT CDF, TTFT over time, tokens/s, requests/s."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    (cdf, ttft_t), (tok_t, req_t) = fig.subplots(2, 2)
    for r in runs:
        ok = [x.ttft for x in r.result.records if x.ok and not x.warmup and x.ttft is not None]
        if ok:
            xs = sorted(v * 1e3 for v in ok)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            cdf.step(xs, ys, where="post", label=r.label)
        buckets = timeline(r.result.records, bucket)
        ts = [b.t + bucket / 2 for b in buckets]
        (line,) = ttft_t.plot(ts, [b.ttft_p99 * 1e3 for b in buckets], label=f"{r.label} p99")
        ttft_t.plot(
            ts,
            [b.ttft_p50 * 1e3 for b in buckets],
            linestyle="--",
            color=line.get_color(),
            label=f"{r.label} p50",
        )
        tok_t.plot(ts, [b.tokens / bucket for b in buckets], label=r.label)
        req_t.plot(ts, [b.completed / bucket for b in buckets], label=r.label)
        if any(b.errors for b in buckets):
            req_t.plot(
                ts,
                [b.errors / bucket for b in buckets],
                linestyle=":",
                color=line.get_color(),
                label=f"{r.label} errors",
            )
    warmup = max((r.result.load.warmup for r in runs), default=0.0)
    for ax in (ttft_t, tok_t, req_t):
        if warmup:
            ax.axvspan(0, warmup, color="0.9", label="_warm-up")
        ax.set_xlabel("time since start (s)")
        ax.grid(alpha=0.3)
    cdf.set_xscale("log")
    cdf.set(xlabel="TTFT (ms, log)", ylabel="share of requests", title="TTFT CDF (measured)")
    cdf.grid(alpha=0.3, which="both")
    ttft_t.set(ylabel="TTFT (ms)", title="TTFT by request start time (p99 solid, p50 dashed)")
    ttft_t.set_yscale("log")
    tok_t.set(ylabel="output tokens/s", title="output throughput")
    req_t.set(ylabel="requests/s", title="completed requests (errors dotted)")
    for ax in (cdf, ttft_t, tok_t, req_t):
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
