"""A soak run's files: ``result.json``, ``report.md`` and ``plot.png``.

``markdown`` and ``timeline`` are pure (the result document in, text or buckets out); ``plot``
draws with matplotlib's Agg backend, as ``loadtest.report`` does.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtest.report import clean
from loadtest.soak.faults import FaultWindow
from loadtest.soak.invariants import ALWAYS_FINE, excused
from loadtest.soak.outcomes import Observation, Outcome

LEFT = frozenset({"left_before_head", "left_after_head", "left_mid_stream", "left_nonstream_wait"})


def timeline(
    results: Sequence[tuple[Observation, Outcome]],
    windows: Sequence[FaultWindow],
    backends: Sequence[str],
    *,
    end: float,
    bucket: float = 5.0,
) -> list[dict[str, Any]]:
    """Requests by the bucket they ended in: done, ok, left, excused errors, failures."""
    n = max(1, math.ceil(end / bucket))
    rows = [Counter[str]() for _ in range(n)]
    for o, c in results:
        row = rows[min(n - 1, max(0, int(o.end // bucket)))]
        row["done"] += 1
        if c == "ok":
            row["ok"] += 1
        elif c in LEFT:
            row["left"] += 1
        elif c in ALWAYS_FINE:
            row["refused"] += 1  # rate limits, bad input, a wrong key: answered as they should be
        elif excused(o, c, windows, backends):
            row["excused"] += 1
        else:
            row["failed"] += 1
    keys = ("done", "ok", "left", "refused", "excused", "failed")
    return [{"t": round(i * bucket, 1), **{k: row[k] for k in keys}} for i, row in enumerate(rows)]


def write_json(path: Path, doc: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(clean(dict(doc)), indent=1, allow_nan=False) + "\n")


def _cell(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return [*out, ""]


def markdown(doc: Mapping[str, Any]) -> str:
    """The human summary of a run: the verdicts first, then the figures behind them."""
    passed = doc["passed"]
    lines = [
        f"# Soak: {'PASS' if passed else 'FAIL'}",
        "",
        f"{doc['title']}. Run directory `{doc['out']}`, {doc['wall_s']:.0f} s of wall time.",
        "",
        "## Invariants",
        "",
    ]
    lines += _table(
        ("invariant", "result", "why"),
        [(v["name"], "pass" if v["passed"] else "**FAIL**", v["why"]) for v in doc["invariants"]],
    )
    req = doc["requests"]
    lines += ["## Requests by outcome", "", f"{req['total']} requests.", ""]
    lines += _table(("outcome", "requests"), sorted(req["by_outcome"].items()))
    lines += ["## Faults", ""]
    lines += _table(
        ("kind", "target", "start (s)", "end (s)", "ok", "detail"),
        [
            (w["kind"], w["target"] or "", w["start_s"], w["end_s"], w["ok"], w["detail"])
            for w in doc["faults"]["windows"]
        ],
    )
    lines += ["## Memory (RSS MiB, series)", ""]
    rows = []
    for r, m in doc["memory"].items():
        rss, series = m["rss_mb"], m["series"]
        rows.append(
            (r, rss["start"], rss["warm"], rss["end"], m["rss_growth_mb"], series["start"],
             series["warm"], series["end"], m["prefix_index_mb"])
        )  # fmt: skip
    lines += _table(
        ("replica", "RSS start", "RSS warm", "RSS end", "growth", "series start", "series warm",
         "series end", "prefix index MiB"),
        rows,
    )  # fmt: skip
    lines += ["## Limits probes (internal-tools, 60/min)", ""]
    lines += _table(
        ("at (s)", "sent", "admitted", "expected (range)", "429 rate", "429 concurrency",
         "elapsed (s)"),
        [
            (p["at_s"], p["sent"], p["admitted"], _range(p), p["rate_limited"],
             p["concurrency_limited"], p["elapsed_s"])
            for p in doc["limits_probes"]
        ],
    )  # fmt: skip
    lines += _redis_faults(doc["invariants"])
    aborts = next((v for v in doc["invariants"] if v["name"] == "aborted_upstream"), None)
    if aborts is not None:
        lines += ["## Aborts", ""]
        lines += _table(
            ("figure", "value"),
            [(k, v) for k, v in aborts.items() if k not in ("name", "passed", "why")],
        )
    failed = [v for v in doc["invariants"] if not v["passed"]]
    for v in failed:
        examples = v.get("examples") or v.get("problems")
        if examples:
            lines += [f"## Why {v['name']} failed", "", "```"]
            lines += [json.dumps(e) for e in examples]
            lines += ["```", ""]
    return "\n".join(lines)


def _answer(call: Mapping[str, Any]) -> str:
    said = str(call["status"]) + (f" {call['state']}" if call.get("state") else "")
    said += f" {call['code']}" if call.get("code") else ""
    return said + (" replayed" if call.get("replayed") else "") + f" (r{call['through']})"


def _redis_faults(invariants: Sequence[Mapping[str, Any]]) -> list[str]:
    """The admin changes made under Redis faults, and each empty restart of Redis."""
    by_name = {v["name"]: v for v in invariants}
    lines: list[str] = []
    answers = by_name.get("admin_answers_true", {})
    if answers.get("detail"):
        lines += ["## Admin changes under Redis faults", ""]
        lines += _table(
            ("phase", "change", "answers", "fate (every replica)", "repeat", "entries"),
            [
                (
                    c["phase"],
                    c["what"],
                    ", ".join(_answer(call) for call in c["calls"]),
                    "/".join(sorted(set(c["settled"]))),
                    "" if c["repeat"] is None else _answer(c["repeat"]),
                    "" if c["entries"] is None else c["entries"],
                )
                for c in answers["detail"]
            ],
        )
    losses = by_name.get("lost_log_healed", {}).get("losses")
    if losses:
        lines += ["## Redis restarted empty", ""]
        lines += _table(
            ("at (s)", "losses", "healed", "whole after (s)", "same state", "spent before/after"),
            [
                (
                    x["at_s"],
                    x["losses"],
                    x["healed"],
                    x["healed_after_s"],
                    x["same_state"],
                    f"{x['spent_before']} / {x['spent_after']}",
                )
                for x in losses
            ],
        )
    return lines


def plot(doc: Mapping[str, Any], path: Path) -> None:
    """RSS, in-flight requests and errors over time, the fault windows shaded."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 10), layout="constrained")
    FigureCanvasAgg(fig)
    rss_ax, flight_ax, err_ax = fig.subplots(3, 1, sharex=True)
    samples = doc["samples"]
    for r in sorted({s["replica"] for s in samples}):
        mine = [s for s in samples if s["replica"] == r]
        ts = [s["t"] for s in mine]
        rss_ax.plot(ts, [s["rss_mb"] for s in mine], label=f"replica {r}")
        flight_ax.plot(ts, [s["in_flight"] for s in mine], label=f"replica {r}")
    rows = doc["timeline"]
    bucket = rows[1]["t"] - rows[0]["t"] if len(rows) > 1 else 5.0
    ts = [row["t"] + bucket / 2 for row in rows]
    for key, style in (("failed", "-"), ("excused", "--"), ("left", ":")):
        err_ax.plot(ts, [row[key] / bucket for row in rows], linestyle=style, label=key)
    colours = {"kill": "tab:red", "hang": "tab:orange", "error_burst": "tab:purple",
               "redis_kill": "tab:brown", "redis_pause": "tab:olive"}  # fmt: skip
    for w in doc["faults"]["windows"]:
        colour = colours.get(w["kind"])
        for ax in (rss_ax, flight_ax, err_ax):
            if colour is not None:
                ax.axvspan(
                    w["start_s"], max(w["end_s"], w["start_s"] + 0.5), color=colour, alpha=0.15
                )
            else:
                ax.axvline(w["start_s"], color="0.6", linewidth=0.8, linestyle="--")
        if colour is not None or w["kind"] != "limits_probe":
            label = w["kind"] + (f" {w['target']}" if w["target"] else "")
            err_ax.annotate(label, (w["start_s"], 1.0), xycoords=("data", "axes fraction"),
                            rotation=90, fontsize="x-small", va="top")  # fmt: skip
    warm = doc["warm_until_s"]
    for ax in (rss_ax, flight_ax, err_ax):
        ax.axvspan(0, warm, color="0.92", zorder=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="upper left")
    rss_ax.set(ylabel="RSS (MiB)", title="gateway RSS (warm-up shaded grey; faults in colour)")
    flight_ax.set(ylabel="requests", title="llm_gateway_backend_in_flight, summed")
    err_ax.set(ylabel="requests/s", xlabel="time since the load started (s)",
               title="failed, excused (by a fault) and abandoned requests")  # fmt: skip
    fig.suptitle(doc["title"])
    fig.savefig(path, dpi=90)


def _range(probe: dict[str, Any]) -> str:
    low, high = probe.get("expected_range") or (probe["expected"], probe["expected"])
    return f"{probe['expected']} ({low}-{high})"
