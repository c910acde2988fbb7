"""The peer bench's markdown page, rendered from its results JSON (the JSON is the source:
``python -m loadtest.peers --render FILE.json`` re-makes the page)."""

from __future__ import annotations

from typing import Any, Final

from loadtest.peers.targets import PROFILES

NONE: Final = "\u2013"  # an en dash, for a figure the run does not have


def _g(d: Any, *ks: str) -> Any:
    for k in ks:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _f(v: Any, nd: int = 1) -> str:
    if v is None:
        return NONE
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _ratio(a: Any, b: Any, nd: int = 2) -> str:
    if a is None or b in (None, 0):
        return NONE
    return f"{a / b:.{nd}f}"


def _peers(res: dict[str, Any]) -> list[str]:
    out = [
        "## Peers\n",
        "| target | version | status | idle RSS MB | command |",
        "|---|---|---|---|---|",
    ]
    for name, t in res["targets"].items():
        rss = _g(t, "profiles", "paced", "idle_rss_mb") or _g(t, "profiles", "fast", "idle_rss_mb")
        cmd = (t.get("command") or t.get("note") or "").replace("|", "\\|")
        st = t.get("status", "?")
        if t.get("error"):
            st += ": " + t["error"].splitlines()[0][:120].replace("|", "\\|")
        out.append(f"| {name} | {t.get('version') or NONE} | {st} | {_f(rss)} | `{cmd}` |")
    out.append("")
    return out


def _row(name: str, c: str, r: dict[str, Any], d: dict[str, Any]) -> str:
    t50, t99 = _g(r, "ttft_ms", "p50"), _g(r, "ttft_ms", "p99")
    d50, d99 = _g(d, "ttft_ms", "p50"), _g(d, "ttft_ms", "p99")
    delta = NONE if t50 is None or d50 is None else f"{t50 - d50:+.2f}"
    return (
        f"| {name} | {c} | {r.get('requests_ok')} | {r.get('errors')}/{r.get('timeouts')} "
        f"| {_f(t50, 2)} | {_f(t99, 2)} | {delta} | {_ratio(t50, d50)} | {_ratio(t99, d99)} "
        f"| {_f(_g(r, 'itl_ms', 'mean'), 3)} | {_f(_g(r, 'itl_ms', 'p99'), 2)} "
        f"| {_f(_g(r, 'e2e_ms', 'p50'), 1)} | {_f(_g(r, 'e2e_ms', 'p99'), 1)} "
        f"| {_f(r.get('req_per_s'))} | {_f(r.get('events_per_s'), 0)} "
        f"| {_ratio(r.get('events_per_s'), d.get('events_per_s'))} "
        f"| {_f(r.get('proxy_cpu_pct'))} | {_f(r.get('proxy_cpu_us_per_event'), 2)} "
        f"| {_f(r.get('proxy_peak_rss_mb'))} |"
    )


def _profile(res: dict[str, Any], prof: str) -> list[str]:
    out = [
        f"## Profile `{prof}` — {PROFILES.get(prof, {}).get('desc', '')}\n",
        "| target | c | ok | err/to | TTFT p50 | TTFT p99 | ΔTTFT p50 | TTFT p50 ratio "
        "| TTFT p99 ratio | ITL mean | ITL p99 | E2E p50 | E2E p99 | req/s | events/s "
        "| events/s ratio | proxy CPU% | CPU µs/event | peak RSS MB |",
        "|---|" + "---:|" * 18,
    ]
    direct = res["targets"].get("direct", {})
    for name, t in res["targets"].items():
        p = _g(t, "profiles", prof)
        if not p:
            continue
        if p.get("error") and not p.get("levels"):
            why = p["error"].splitlines()[0][:100].replace("|", "/")
            out.append(f"| {name} | {NONE} | failed: {why} |" + " |" * 16)
            continue
        for c, r in p.get("levels", {}).items():
            if r.get("skipped") or r.get("error"):
                out.append(f"| {name} | {c} | {r.get('skipped') or r.get('error')} |" + " |" * 16)
                continue
            d = _g(direct, "profiles", prof, "levels", c) or {}
            out.append(_row(name, c, r, d))
    out.append("")
    return out


def _backends(res: dict[str, Any]) -> list[str]:
    """The fake backends' own CPU, in the runs that measured it (none before 2026-12-07)."""
    rows = [
        f"| {name} | {prof} | {c} | {_f(r.get('events_per_s'), 0)} "
        f"| {_f(r.get('backends_cpu_pct'))} | {_f(r.get('backends_cpu_us_per_event'), 2)} |"
        for name, t in res["targets"].items()
        for prof, p in (t.get("profiles") or {}).items()
        for c, r in (p.get("levels") or {}).items()
        if r.get("backends_cpu_pct") is not None
    ]
    if not rows:
        return []
    head = [
        "## The fake backends\n",
        "Both backends' CPU (CPU 1, shared with loadgen) over each level; µs/event is per "
        "content event the client received.\n",
        "| target | profile | c | events/s | backends CPU% | CPU µs/event |",
        "|---|---|---:|---:|---:|---:|",
    ]
    return [*head, *rows, ""]


def render_md(res: dict[str, Any]) -> str:
    """The page for one run's results, as the bench has written it since its first run."""
    m = res["meta"]
    a = m["args"]
    out = [
        f"# Gateway SSE forwarding benchmark — {m['date']}\n",
        f"Host: {m.get('cpu', '?')}, {m.get('nproc')} cores, Python {m.get('python')}. "
        f"Proxy pinned to CPU {a['proxy_cpu']}; fake backends (2) + loadgen pinned to CPU "
        f"{a['client_cpu']}. Endpoint `{a['endpoint']}`, closed loop, "
        f"{a['duration']} s per level ({a['duration_c1']} s at c=1).\n",
        "Ratios are target / direct at the same profile and concurrency; "
        "ΔTTFT is target minus direct (ms). CPU% and µs/event are the proxy's own "
        "(process tree, CPU 0); 100% means the proxy's core is saturated.\n",
    ]
    out += _peers(res)
    for prof in a["profiles"]:
        out += _profile(res, prof)
    out += _backends(res)
    fails = [(n, t) for n, t in res["targets"].items() if t.get("status") != "ok"]
    if fails:
        out.append("## Failures\n")
        for n, t in fails:
            errs = [t.get("error")] + [
                f"{pn}: {pv.get('error')}"
                for pn, pv in t.get("profiles", {}).items()
                if pv.get("error")
            ]
            out.append(
                f"- **{n}** ({t.get('status')}): "
                + " / ".join(e.splitlines()[0][:300] for e in errs if e)
            )
        out.append("")
    out.append(
        "Times in ms. err/to = failed requests / requests cancelled at the end of the grace "
        "period. ITL is the gap between successive content events as read by the client; events "
        "that arrive in the same socket read count as 0 ms gaps.\n"
    )
    out.append(
        "Caveats: 2 cores only. The fake backends and loadgen share one core, so `direct` itself "
        "is client-bound in `fast` at every level and in `paced` at the top level (look for a "
        "direct TTFT p50 far above the backend's TTFT); there, events/s ratios near 1.0 mean "
        '"not slower than the client side" and proxy CPU µs/event is the better yardstick. '
        "Short runs (10-15 s): differences under ~10 % are noise. CPU µs/event at c=1 includes "
        "the target's idle background work.\n"
    )
    return "\n".join(out)
