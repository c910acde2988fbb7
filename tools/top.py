"""``llm-gateway top``: a live terminal view of a running gateway's backends.

It polls the admin API (``/admin/backends`` and ``/admin/metrics``) once a second and shows,
per backend: health, circuit, in-flight, queue, KV usage, score, requests per second and time
to first token (p50, p99) over the last interval, and the TTFT and inter-token latency the
gateway predicts for it as loaded now (its learned speed); with capacity on
(``/admin/capacity``), each engine's state (awake, going to sleep, asleep, waking), and below
the table how many are in each, who manages and the engine-seconds asleep it counted; below
that, the retry budget (the extra attempts it took and refused per kind, this replica's use of
it, whether it decides alone while Redis is out of reach) and the requests the admission queue
shed; in a fleet, below them, every replica (``/admin/replicas``) with the last change it
applied, the requests it served and its view of the fleet's change log (ok; lost, being healed;
unreachable; on another epoch), and the fleet's figures summed over the replicas. While Redis
does not answer, the gateway answers the replicas from the last state known: ``top`` marks them
stale, with their age. The arithmetic is pure (``Frame``); only ``run`` does I/O.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gateway.fleet.figures import quantile

DESCRIPTION: Final = (
    "Live view of a running gateway: per backend health, circuit, in-flight requests, queue "
    "depth, KV-cache usage, routing score, requests/s, time to first token (p50/p99) and the "
    "predicted TTFT and inter-token latency (learned), with capacity on each engine's state "
    "(awake, going to sleep, asleep, waking) and the engine-seconds asleep; the retry budget "
    "(extra attempts taken and refused) and the requests the admission queue shed; refreshed "
    "every second. Needs the admin API (its URL and bearer token)."
)
TOKEN_ENV: Final = "GATEWAY_ADMIN__TOKEN"  # the one the gateway reads (``admin.token``)
# What ``top --help`` once named instead: still read, with a warning, so a shell set up from
# that help keeps working until it is changed.
OLD_TOKEN_ENV: Final = "LLM_GATEWAY_ADMIN_TOKEN"

# (backend) -> cumulative request count; (backend) -> [(le, cumulative count)]
Counts = dict[str, float]
Buckets = dict[str, list[tuple[float, float]]]


@dataclass(frozen=True, slots=True)
class BudgetSample:
    """The retry budget as ``/admin/metrics`` says it (``gateway.limits.retry_budget``)."""

    attempts: dict[tuple[str, str], float] = field(default_factory=dict)  # (kind, outcome)
    use: float | None = None  # this replica's extra attempts / what its own requests allow
    degraded: bool | None = None  # None: this gateway's own budget (its limits keep no Redis)


@dataclass(frozen=True, slots=True)
class MetricsSample:
    at: float
    requests: Counts = field(default_factory=dict)
    ttft: Buckets = field(default_factory=dict)
    budget: BudgetSample | None = None  # None: a gateway of before the budget
    shed: float | None = None  # requests the admission queue shed; None: no queue


def parse_metrics(text: str, at: float) -> MetricsSample:
    """Requests and TTFT buckets per backend, summed over models and statuses; the retry
    budget; the admission queue's sheddings."""
    requests: Counts = {}
    ttft: dict[str, dict[float, float]] = {}
    attempts: dict[tuple[str, str], float] | None = None
    gauges: dict[str, float] = {}
    shed = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            backend = s.labels.get("backend")
            if s.name == "llm_gateway_requests_total" and backend is not None:
                requests[backend] = requests.get(backend, 0.0) + s.value
            elif s.name == "llm_gateway_time_to_first_token_seconds_bucket" and backend is not None:
                le = float(s.labels["le"])
                per = ttft.setdefault(backend, {})
                per[le] = per.get(le, 0.0) + s.value
            elif s.name == "llm_gateway_retry_budget_attempts_total":
                attempts = {} if attempts is None else attempts
                attempts[s.labels["kind"], s.labels["outcome"]] = s.value
            elif s.name in ("llm_gateway_retry_budget_use", "llm_gateway_retry_budget_degraded"):
                gauges[s.name] = s.value
            elif s.name == "llm_gateway_admission_outcomes_total":
                shed = (shed or 0.0) + (s.value if s.labels["outcome"] == "shed" else 0.0)
    budget = None
    if attempts is not None:
        degraded = gauges.get("llm_gateway_retry_budget_degraded")
        budget = BudgetSample(
            attempts,
            gauges.get("llm_gateway_retry_budget_use"),
            None if degraded is None else degraded > 0,
        )
    ttft_buckets = {b: sorted(per.items()) for b, per in ttft.items()}
    return MetricsSample(at, requests, ttft_buckets, budget, shed)


def bucket_quantile(buckets: Iterable[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style quantile from cumulative buckets (linear within a bucket)."""
    return quantile(buckets, q)


def _delta_buckets(
    cur: list[tuple[float, float]], prev: list[tuple[float, float]] | None
) -> list[tuple[float, float]]:
    before = dict(prev or [])
    return [(le, c - before.get(le, 0.0)) for le, c in cur]


@dataclass(frozen=True, slots=True)
class Row:
    backend: str
    health: str
    circuit: str
    draining: bool
    in_flight: int
    queue: int | None
    kv: float | None
    score: float | None
    rps: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    predicted_ttft: float | None = None  # seconds, learned (``policies.latency``)
    predicted_itl: float | None = None
    state: str | None = None  # capacity's: awake, going_to_sleep, asleep, waking (None: not shown)


def frame(
    backends: Mapping[str, Any],
    cur: MetricsSample,
    prev: MetricsSample | None,
    states: Mapping[str, str] | None = None,
) -> list[Row]:
    """One frame's rows from the admin view and two metric samples (rates over the gap), with
    each engine's state from ``states`` (backend -> state) when given."""
    rows = []
    dt = (cur.at - prev.at) if prev is not None else 0.0
    for b in backends.get("backends", []):
        bid = b["id"]
        rps = p50 = p99 = None
        if prev is not None and dt > 0:
            rps = (cur.requests.get(bid, 0.0) - prev.requests.get(bid, 0.0)) / dt
            window = _delta_buckets(cur.ttft.get(bid, []), prev.ttft.get(bid))
            p50, p99 = bucket_quantile(window, 0.5), bucket_quantile(window, 0.99)
        rows.append(
            Row(
                backend=bid,
                health=b["health"],
                circuit=b["circuit"],
                draining=bool(b["draining"]),
                in_flight=int(b["in_flight"]),
                queue=b.get("queue_depth"),
                kv=b.get("kv_cache_usage"),
                score=b.get("score"),
                rps=rps,
                ttft_p50=p50,
                ttft_p99=p99,
                predicted_ttft=(b.get("latency") or {}).get("predicted_ttft_s"),
                predicted_itl=(b.get("latency") or {}).get("predicted_itl_s"),
                state=None if states is None else states.get(bid),
            )
        )
    return rows


def _fmt(v: float | None, pattern: str) -> str:
    return "-" if v is None else pattern.format(v)


# An engine's state (capacity) -> shown as, style: the two on their way in italics
STATES: Final = {
    "awake": ("awake", "green"),
    "going_to_sleep": ("going to sleep", "italic yellow"),
    "asleep": ("asleep", "blue"),
    "waking": ("waking", "italic cyan"),
}


def state_text(state: str | None) -> Text:
    if state is None:
        return Text("-")
    shown, style = STATES.get(state, (state, "magenta"))
    return Text(shown, style=style)


def render(rows: list[Row], policy: str) -> Table:
    table = Table(title=f"llm-gateway backends  (policy: {policy})", expand=False)
    with_state = any(r.state is not None for r in rows)
    for col in (
        "backend", "health", "circuit", *(["state"] if with_state else []), "in-flight",
        "queue", "KV", "score", "req/s", "TTFT p50", "TTFT p99", "TTFT pred", "ITL pred",
    ):  # fmt: skip
        table.add_column(col, justify="left" if col == "backend" else "right")
    colour = {"up": "green", "down": "red", "unknown": "yellow"}
    for r in rows:
        health = f"[{colour.get(r.health, 'white')}]{r.health}[/]"
        if r.draining:
            health += " [yellow](draining)[/]"
        table.add_row(
            r.backend,
            health,
            r.circuit,
            *([state_text(r.state)] if with_state else []),
            str(r.in_flight),
            _fmt(r.queue, "{:d}"),
            _fmt(None if r.kv is None else r.kv * 100, "{:.0f}%"),
            _fmt(r.score, "{:.1f}"),
            _fmt(r.rps, "{:.1f}"),
            _fmt(None if r.ttft_p50 is None else r.ttft_p50 * 1e3, "{:.0f} ms"),
            _fmt(None if r.ttft_p99 is None else r.ttft_p99 * 1e3, "{:.0f} ms"),
            _fmt(None if r.predicted_ttft is None else r.predicted_ttft * 1e3, "{:.0f} ms"),
            _fmt(None if r.predicted_itl is None else r.predicted_itl * 1e3, "{:.1f} ms"),
        )
    return table


def _ms(seconds: float | None) -> str:
    return _fmt(None if seconds is None else seconds * 1e3, "{:.0f} ms")


def _shares(counts: Mapping[str, int], most: int = 6) -> str:
    """``a 60 (75%) · b 20 (25%)``, the largest first."""
    whole = sum(counts.values())
    ranked = sorted(counts.items(), key=lambda e: (-e[1], e[0]))[:most]
    return " · ".join(f"{k} {n} ({n / whole:.0%})" if whole else f"{k} {n}" for k, n in ranked)


def fleet_lines(summary: Mapping[str, Any]) -> list[str]:
    """Below the replicas: the backends whose health they see differently, and the fleet's
    figures (``summary.figures``, summed over the replicas), a line each."""
    lines = [
        f"health seen differently: {backend} ({', '.join(f'{r} {v}' for r, v in seen.items())})"
        for backend, seen in (summary.get("disagree") or {}).items()
    ]
    figures = summary.get("figures")
    if figures is None:  # a replica of before the figures answered
        return lines
    lines.append(
        f"fleet: {figures['requests']} requests · {figures['errors']} errors (5xx) · TTFT p50 "
        f"{_ms(figures.get('ttft_p50_s'))} p99 {_ms(figures.get('ttft_p99_s'))}"
    )
    if figures["decisions"]:
        lines.append(f"routed: {_shares(figures['decisions'])}")
    for alias, pools in sorted(figures["canary"].items()):
        lines.append(f"canary {alias}: {_shares(pools)}")
    if figures["rejections"]:
        ranked = sorted(figures["rejections"].items(), key=lambda e: (-e[1], e[0]))
        lines.append("rejected: " + " · ".join(f"{k} {n}" for k, n in ranked[:8]))
    return lines


def capacity_shown(capacity: Mapping[str, Any] | None) -> bool:
    """Capacity's column and line: when it is on, or an engine is not awake all the same (slept
    by hand with the manager off); never from a gateway without ``/admin/capacity``."""
    if capacity is None:
        return False
    return bool(capacity["enabled"]) or any(e["state"] != "awake" for e in capacity["engines"])


def engine_states(capacity: Mapping[str, Any] | None) -> dict[str, str] | None:
    """Each engine's state (backend -> state) for the table, None when capacity is not shown."""
    if capacity is None or not capacity_shown(capacity):
        return None
    return {e["backend"]: e["state"] for e in capacity["engines"]}


@dataclass(frozen=True, slots=True)
class ManagerLook:
    """The capacity manager's last turn (``look``) and who made it: ``by`` None when the
    gateway acts alone; ``look`` None while no replica manages."""

    look: Mapping[str, Any] | None
    by: str | None
    alone: bool


def manager_of(capacity: Mapping[str, Any], replicas: Mapping[str, Any]) -> ManagerLook:
    """The replica asked's own turn when it manages, else the managing replica's as its report
    carries it (the newer lease's, should two during a hand-over)."""
    alone = replicas.get("fleet") is None
    if capacity.get("managing"):
        look = capacity.get("look") or {}
        by = None if alone else replicas["self"]
        return ManagerLook(look if "models" in look else None, by, alone)
    reports = [r for r in replicas.get("replicas", []) if "models" in (r.get("capacity") or {})]
    if not reports:
        return ManagerLook(None, None, alone)
    r = max(reports, key=lambda r: r["capacity"].get("token") or 0)
    return ManagerLook(r["capacity"], r["id"], alone)


def capacity_line(capacity: Mapping[str, Any] | None, replicas: Mapping[str, Any]) -> Text | None:
    """Below the backends: the engines in each state, who manages, and the engine-seconds asleep
    the manager counted (the one count at hand here: a replica that managed before counts its
    own, so in a fleet the total is ``llm_gateway_capacity_asleep_seconds_total`` summed over
    the replicas); None when capacity is not shown."""
    if capacity is None or not capacity_shown(capacity):
        return None
    line = Text("capacity: " if capacity["enabled"] else "capacity (manager OFF): ")
    counts = capacity["states"]
    for i, state in enumerate(STATES):
        if i:
            line.append(" · ")
        line.append_text(state_text(state))
        line.append(f" {counts.get(state, 0)}")
    m = manager_of(capacity, replicas)
    if m.look is None:
        line.append(" · no replica manages yet")
        return line
    seconds = f"{m.look.get('asleep_seconds', 0):,.0f} engine-s asleep"
    if m.alone:
        line.append(f" · managed by this gateway · {seconds} since it started")
    else:
        mine = " (this one)" if m.by == replicas.get("self") else ""
        line.append(
            f" · managed by {m.by}{mine} · {seconds} counted by it while it managed "
            "(the fleet's: llm_gateway_capacity_asleep_seconds_total summed over the replicas)"
        )
    return line


BUDGET_KINDS: Final = ("retry", "hedge", "continuation")


def limits_line(sample: MetricsSample) -> Text | None:
    """Below the backends: the retry budget (whose it is, this replica's use of it, per kind
    the extra attempts taken and refused) and the requests the admission queue shed; None from
    a gateway that says neither."""
    budget, shed = sample.budget, sample.shed
    if budget is None and shed is None:
        return None
    line = Text()
    if budget is not None:
        use = "-" if budget.use is None else f"{budget.use:.0%}"
        if budget.degraded is None:
            line.append(f"retry budget (this gateway's own): {use} used")
        elif budget.degraded:
            line.append("retry budget: DEGRADED, Redis out of reach: ", style="bold yellow")
            line.append(f"this replica decides alone, {use} of its own used")
        else:
            line.append(f"retry budget (the fleet's, on Redis): {use} of this replica's used")
        kinds = [*BUDGET_KINDS, *sorted({k for k, _ in budget.attempts} - set(BUDGET_KINDS))]
        for kind in kinds:
            taken = budget.attempts.get((kind, "taken"), 0.0)
            refused = budget.attempts.get((kind, "refused"), 0.0)
            line.append(f" · {kind} {taken:.0f} taken, ")
            line.append(f"{refused:.0f} refused", style="yellow" if refused else "")
    if shed is not None:
        if budget is not None:
            line.append(" · ")
        line.append("admission queue: ")
        line.append(f"{shed:.0f} shed", style="yellow" if shed else "")
    return line


# A change log's state (the replica's own word, or the fleet's: "other epoch") -> shown as, colour
LOG_STATES: Final = {
    "ok": ("ok", "green"),
    "lost": ("lost, healing", "red"),
    "unreachable": ("unreachable", "red"),
    "other epoch": ("other epoch", "yellow"),
}


def log_text(state: str | None) -> Text:
    """A change log's state as ``top`` shows it (``-`` from a replica that does not say)."""
    if state is None:
        return Text("-")
    shown, colour = LOG_STATES.get(state, (state, "yellow"))
    return Text(shown, style=colour)


def stale_text(stale: Mapping[str, Any]) -> Text:
    """The mark of a view answered from the last state known (Redis does not answer)."""
    why = f" ({stale['why']})" if stale.get("why") else ""
    age = stale.get("age_s")
    when = (
        "nothing read from it since this replica started: this replica alone"
        if age is None
        else f"as of {age:.0f} s ago"
    )
    return Text(f"STALE: Redis does not answer{why}; the replicas {when}", style="bold yellow")


def log_lines(doc: Mapping[str, Any]) -> list[Text]:
    """Below the title: the view's stale mark, and how often this replica found the fleet's
    log lost (Redis lost its data; each loss healed by the replica furthest ahead)."""
    lines = []
    if doc.get("stale"):
        lines.append(stale_text(doc["stale"]))
    losses = doc.get("losses") or 0
    if losses:
        times = "time" if losses == 1 else "times"
        lines.append(
            Text(
                f"change log found lost {losses} {times} since this replica started "
                "(Redis lost its data)",
                style="yellow",
            )
        )
    return lines


def render_replicas(doc: Mapping[str, Any]) -> RenderableType | None:
    """The fleet's replicas (``GET /admin/replicas``) and, below them, its figures summed over
    them; None when the gateway acts alone."""
    if doc.get("fleet") is None:
        return None
    summary = doc["summary"]
    lag = ", ".join(summary["lagging"]) or "none"
    title = Text(
        f"fleet {doc['fleet']}: {summary['replicas']} replicas, log at {summary['head']}, "
        f"behind: {lag}, change log "
    )
    title.append_text(log_text(doc.get("log")))
    table = Table(title=title, expand=False)
    for col in ("replica", "version", "address", "up", "in-flight", "requests", "applied", "log"):
        table.add_column(col, justify="left" if col in ("replica", "address") else "right")
    problems = summary.get("log_problems") or {}
    for r in doc["replicas"]:
        name = r["id"] + (" *" if r["id"] == doc.get("self") else "")
        behind = r["id"] in summary["lagging"]
        requests = (r.get("figures") or {}).get("requests")
        table.add_row(
            name,
            r["version"],
            r["address"],
            f"{r['uptime_s']:.0f} s",
            str(sum(r["in_flight"].values())),
            "-" if requests is None else str(requests),
            f"[yellow]{r['applied']}[/]" if behind else str(r["applied"]),
            log_text(problems.get(r["id"], r.get("log"))),
        )
    above = log_lines(doc)
    lines = fleet_lines(summary)
    parts: list[RenderableType] = [*above, table]
    if lines:
        parts.append(Text("\n".join(lines)))
    return Group(*parts) if len(parts) > 1 else table


class TopClient:
    def __init__(self, session: aiohttp.ClientSession, admin_url: str, token: str) -> None:
        self._session = session
        self._url = admin_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self._prev: MetricsSample | None = None

    async def _get(self, path: str) -> aiohttp.ClientResponse:
        resp = await self._session.get(self._url + path, headers=self._headers)
        resp.raise_for_status()
        return resp

    async def _capacity(self) -> dict[str, Any] | None:
        """``GET /admin/capacity``; None from a gateway of before capacity (a 404)."""
        async with self._session.get(self._url + "/admin/capacity", headers=self._headers) as r:
            if r.status == 404:
                return None
            r.raise_for_status()
            doc: dict[str, Any] = await r.json()
            return doc

    async def next_frame(self) -> RenderableType:
        async with await self._get("/admin/backends") as r:
            backends = await r.json()
        async with await self._get("/admin/metrics") as r:
            sample = parse_metrics(await r.text(), time.monotonic())
        async with await self._get("/admin/replicas") as r:
            replicas_doc = await r.json()
        capacity = await self._capacity()
        rows = frame(backends, sample, self._prev, engine_states(capacity))
        self._prev = sample
        parts: list[RenderableType] = [render(rows, backends.get("policy", "?"))]
        if (line := capacity_line(capacity, replicas_doc)) is not None:
            parts.append(line)
        if (limits := limits_line(sample)) is not None:
            parts.append(limits)
        if (replicas := render_replicas(replicas_doc)) is not None:
            parts.append(replicas)
        return parts[0] if len(parts) == 1 else Group(*parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--admin", required=True, help="admin API URL, e.g. http://127.0.0.1:8081")
    p.add_argument(
        "--token", help=f"admin bearer token (default: ${TOKEN_ENV}, as the gateway reads it)"
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one frame and exit")


async def _run(args: argparse.Namespace, token: str) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        client = TopClient(s, args.admin, token)
        table = await client.next_frame()
        if args.once:
            await asyncio.sleep(min(args.interval, 1.0))
            Console().print(await client.next_frame())
            return
        with Live(table, refresh_per_second=4) as live:
            while True:
                await asyncio.sleep(args.interval)
                live.update(await client.next_frame())


def admin_token(given: str | None, environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The token to send (``--token``, else the gateway's own variable, else the old name
    ``top`` used to read) and a warning to print when it came from the old name."""
    if given:
        return given, None
    if token := environ.get(TOKEN_ENV):
        return token, None
    if token := environ.get(OLD_TOKEN_ENV):
        return token, f"{OLD_TOKEN_ENV} is deprecated: set {TOKEN_ENV}, as the gateway reads"
    return None, None


def run(args: argparse.Namespace) -> int:
    token, warning = admin_token(args.token, os.environ)
    if warning is not None:
        print(f"llm-gateway top: {warning}", file=sys.stderr, flush=True)
    if not token:
        print(f"llm-gateway top: give --token or set {TOKEN_ENV}", flush=True)
        return 2
    try:
        asyncio.run(_run(args, token))
    except KeyboardInterrupt:
        return 0
    except aiohttp.ClientError as exc:
        print(f"llm-gateway top: cannot read {args.admin}: {exc}", flush=True)
        return 1
    return 0
