"""What must hold after a soak, judged from what was recorded. Pure: figures in, verdicts out.

(The comparison of aborts, the one invariant with a long argument, is ``loadtest.soak.aborts``.)

Each ``check_*`` returns a ``Verdict``: pass or fail, one line saying why, and the figures it
judged, so a report shows the evidence and not only the result.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from loadtest.soak.faults import FaultWindow, PlannedFault, healthy_backends_at
from loadtest.soak.mix import BAD_INPUT
from loadtest.soak.outcomes import (
    BEFORE_FIRST_BYTE_FAILURES,
    Observation,
    Outcome,
    gateway_error_documented,
)

MIB: Final = 1 << 20
RSS_SLACK_BYTES: Final = 8 * MIB
RSS_SLACK_SHARE: Final = 0.10
# A new label set of the three per-(model, backend) histograms is ~80 lines, a counter's 2: a
# late first fault of some kind may add one or two. A per-request label would add thousands.
SERIES_SLACK: Final = 120
ALWAYS_FINE: Final[frozenset[Outcome]] = frozenset(
    {
        "ok",
        "left_before_head",
        "left_after_head",
        "left_mid_stream",
        "left_nonstream_wait",
        "rate_limited",
        "admission_rejected",
        "auth_rejected",
        "bad_input_rejected",
    }
)
EXAMPLES: Final = 10


@dataclass(frozen=True, slots=True)
class Verdict:
    name: str
    passed: bool
    why: str
    figures: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "why": self.why, **self.figures}


def example(obs: Observation, outcome: Outcome) -> dict[str, Any]:
    return {"outcome": outcome, **obs.to_json()}


# -- 1. no leak -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplicaGauges:
    in_flight: Mapping[str, float]  # llm_gateway_backend_in_flight by backend
    queue_length: float
    holding: float


@dataclass(frozen=True, slots=True)
class LeakState:
    """What is still held once the load has stopped; None where it could not be read."""

    replicas: Sequence[ReplicaGauges | None]
    redis_slots: int | None  # sum of ZCARD over the run's concurrency sorted sets
    sims: Mapping[str, tuple[int, int] | None]  # name -> (running, waiting)
    waited_s: float = 0.0
    # For the diagnosis of held slots: when each was taken (its score less the slot TTL), and
    # when the gateways logged a Redis call that timed out (limits_store_unavailable).
    slots_taken_at: tuple[float, ...] = ()
    store_timeouts_at: tuple[float, ...] = ()

    def problems(self) -> list[str]:
        out: list[str] = []
        for i, r in enumerate(self.replicas):
            if r is None:
                out.append(f"replica {i}: /metrics unreadable")
                continue
            out += [f"replica {i}: in_flight{{{b}}} = {v:g}" for b, v in r.in_flight.items() if v]
            if r.queue_length:
                out.append(f"replica {i}: admission_queue_length = {r.queue_length:g}")
            if r.holding:
                out.append(f"replica {i}: admission_holding = {r.holding:g}")
        if self.redis_slots is None:
            out.append("redis: unreadable")
        elif self.redis_slots:
            out.append(f"redis: {self.redis_slots} concurrency slot(s) held")
        for name, load in self.sims.items():
            if load is None:
                out.append(f"{name}: /sim/state unreadable")
            elif any(load):
                out.append(f"{name}: running {load[0]}, waiting {load[1]}")
        return out


def taken_at_a_timeout(
    taken: Sequence[float], timeouts: Sequence[float], before: float = 0.5, after: float = 2.0
) -> int:
    """How many slots were taken around a Redis call the gateway logged as timed out.

    Such a slot is an admission the gateway gave up on (and admitted fail-open, unaccounted)
    while Redis ran it anyway: nobody releases it before its TTL. The gateway logs only the
    first failure of an outage, and Redis may run the script a moment after the gateway gave
    up, hence a window (``before``, ``after``) around each logged timeout.
    """
    return sum(1 for t in taken if any(x - before <= t <= x + after for x in timeouts))


def check_no_leak(state: LeakState) -> Verdict:
    problems = state.problems()
    at_timeout = taken_at_a_timeout(state.slots_taken_at, state.store_timeouts_at)
    if state.redis_slots:
        problems = [
            f"{p} ({at_timeout} taken within 2 s of a logged Redis timeout: an admission "
            "timed out at the gateway but ran in Redis)"
            if p.startswith("redis:")
            else p
            for p in problems
        ]
    figures = {
        "waited_s": round(state.waited_s, 2),
        "replicas": [
            None
            if r is None
            else {"in_flight": dict(r.in_flight), "queue": r.queue_length, "holding": r.holding}
            for r in state.replicas
        ],
        "redis_slots": state.redis_slots,
        "redis_slots_taken_at_s": [round(t, 3) for t in state.slots_taken_at[:50]],
        "redis_slots_taken_at_a_timeout": at_timeout,
        "store_timeouts_at_s": [round(t, 3) for t in state.store_timeouts_at[:50]],
        "sims": {
            n: None if v is None else {"running": v[0], "waiting": v[1]}
            for n, v in state.sims.items()
        },
        "problems": problems,
    }
    if problems:
        return Verdict("no_leak", False, "; ".join(problems), figures)
    why = f"everything released {state.waited_s:.1f} s after the load stopped"
    return Verdict("no_leak", True, why, figures)


# -- 2. no request lost that could have been saved --------------------------------------------


def _no_healthy_during(
    windows: Sequence[FaultWindow], backends: Sequence[str], start: float, end: float
) -> bool:
    times = {start, end} | {t for w in windows for t in (w.start, w.end) if start <= t <= end}
    return any(not healthy_backends_at(windows, backends, t) for t in times)


def excused(
    obs: Observation, outcome: Outcome, windows: Sequence[FaultWindow], backends: Sequence[str]
) -> bool:
    """Whether a failed request's outcome is one the faults on at the time explain."""
    if outcome in ALWAYS_FINE:
        return True
    if outcome == "stream_cut":  # cut by a kill, with no other backend to continue it on
        return any(
            w.kind == "kill" and w.overlaps(obs.start, obs.end, 1.0) for w in windows
        ) and _no_healthy_during(windows, backends, obs.start, obs.end)
    if outcome in ("backend_refused", "backend_error"):  # every candidate answered "not now"
        return any(w.kind == "error_burst" and w.overlaps(obs.start, obs.end, 1.0) for w in windows)
    if outcome in ("no_backend_available", "gateway_error", "connection_error"):
        return _no_healthy_during(windows, backends, obs.start, obs.end)
    return False  # limits_unavailable (fail-open), internal_error, timeouts, broken streams...


def check_no_request_lost(
    results: Sequence[tuple[Observation, Outcome]],
    windows: Sequence[FaultWindow],
    backends: Sequence[str],
) -> Verdict:
    judged = [
        (o, c) for o, c in results if o.behaviour not in BAD_INPUT and o.behaviour != "wrong_key"
    ]
    counts = Counter(c for _, c in judged)
    lost = [(o, c) for o, c in judged if not excused(o, c, windows, backends)]
    lost_by_outcome = dict(Counter(c for _, c in lost))
    figures = {
        "requests": len(judged),
        "by_outcome": dict(sorted(counts.items())),
        "lost": len(lost),
        "lost_by_outcome": lost_by_outcome,
        "before_first_byte_failures": sum(
            n for c, n in counts.items() if c in BEFORE_FIRST_BYTE_FAILURES
        ),
        "stream_cut_by_kill": counts.get("stream_cut", 0),
        "examples": [example(o, c) for o, c in lost[:EXAMPLES]],
    }
    if lost:
        kinds = ", ".join(f"{k} {n}" for k, n in lost_by_outcome.items())
        return Verdict("no_request_lost", False, f"{len(lost)} lost: {kinds}", figures)
    why = (
        f"{len(judged)} requests, {counts.get('ok', 0)} ok; "
        f"{counts.get('stream_cut', 0)} streams cut by a kill with no backend left to continue"
    )
    return Verdict("no_request_lost", True, why, figures)


# -- 3. the gateway's own 5xx are documented ones ---------------------------------------------


def check_gateway_errors(results: Sequence[tuple[Observation, Outcome]]) -> Verdict:
    seen: Counter[str] = Counter()
    bad: list[tuple[Observation, Outcome]] = []
    for o, c in results:
        if o.status < 500 and not (o.stream and o.error is not None and o.status == 200):
            continue
        err = o.error
        who = "backend" if err is not None and err.from_backend else "gateway"
        seen[f"{who}:{o.status}:{None if err is None else err.code}"] += 1
        if not gateway_error_documented(err):
            bad.append((o, c))
    figures = {"errors": dict(sorted(seen.items())), "undocumented": len(bad)}
    figures["examples"] = [example(o, c) for o, c in bad[:EXAMPLES]]
    if bad:
        internal = sum(
            1 for o, _ in bad if o.error is not None and o.error.type == "internal_error"
        )
        why = f"{len(bad)} undocumented 5xx or error events ({internal} internal_error)"
        return Verdict("gateway_errors_documented", False, why, figures)
    total = sum(seen.values())
    return Verdict(
        "gateway_errors_documented", True, f"{total} 5xx/error events, all documented", figures
    )


# -- 4. bad input is a 4xx in OpenAI's envelope -----------------------------------------------


def check_bad_input(results: Sequence[tuple[Observation, Outcome]]) -> Verdict:
    tried = [(o, c) for o, c in results if o.behaviour in BAD_INPUT or o.behaviour == "wrong_key"]
    statuses: dict[str, Counter[int]] = {}
    for o, _ in tried:
        statuses.setdefault(o.behaviour, Counter())[o.status] += 1
    wrong = [(o, c) for o, c in tried if c in ("bad_input_not_rejected", "auth_not_rejected")]
    figures = {
        "sent": len(tried),
        "statuses": {b: {str(s): n for s, n in c.items()} for b, c in sorted(statuses.items())},
        "examples": [example(o, c) for o, c in wrong[:EXAMPLES]],
    }
    if not tried:
        return Verdict("bad_input_rejected", False, "no bad input was sent", figures)
    if wrong:
        why = f"{len(wrong)} of {len(tried)} not a 4xx with an OpenAI error envelope"
        return Verdict("bad_input_rejected", False, why, figures)
    kinds = {o.behaviour for o, _ in tried}
    why = f"{len(tried)} bad requests of {len(kinds)} kinds, each a 4xx with the envelope"
    return Verdict("bad_input_rejected", True, why, figures)


# -- 5. /metrics and /ready answer throughout -------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProbeSample:
    t: float
    replica: int
    path: str  # "/ready" or "/metrics"
    status: int  # 0: no answer
    seconds: float
    error: str | None = None


MAX_POLL_GAP_S: Final = 5.0
# Consecutive unanswered polls of one replica's path that mean it is down: the deployment's own
# readiness probe (deploy/k8s/gateway.yaml) takes a replica out after 2 failures, not 1, so a
# single poll that outlasted its timeout on a starved host is slowness, not an outage.
DOWN_AFTER_MISSES: Final = 2


def _missed(p: ProbeSample) -> bool:
    """No answer within the poll's timeout (a wrong answer or a refused connection is not this)."""
    return p.status == 0 and (p.error or "").startswith("TimeoutError")


def _isolated_misses(polls: Sequence[ProbeSample]) -> set[int]:
    """Indices of timed-out polls with fewer than ``DOWN_AFTER_MISSES`` in a row around them."""
    series: dict[tuple[int, str], list[int]] = {}
    for i, p in enumerate(polls):
        series.setdefault((p.replica, p.path), []).append(i)
    out: set[int] = set()
    for idx in series.values():
        idx.sort(key=lambda i: polls[i].t)
        run: list[int] = []
        for i in [*idx, -1]:
            if i >= 0 and _missed(polls[i]):
                run.append(i)
                continue
            if run and len(run) < DOWN_AFTER_MISSES:
                out.update(run)
            run = []
    return out


def check_availability(
    polls: Sequence[ProbeSample],
    windows: Sequence[FaultWindow],
    backends: Sequence[str],
    replicas: int,
) -> Verdict:
    isolated = _isolated_misses(polls)
    bad = [
        p
        for i, p in enumerate(polls)
        if p.status != 200
        and i not in isolated
        and not (
            p.path == "/ready"
            and p.status == 503
            and not healthy_backends_at(windows, backends, p.t)
        )
    ]
    gaps: dict[str, float] = {}
    for r in range(replicas):
        for path in ("/ready", "/metrics"):
            ts = sorted(p.t for p in polls if p.replica == r and p.path == path)
            gap = max((b - a for a, b in itertools.pairwise(ts)), default=float("inf"))
            gaps[f"{r}{path}"] = round(gap, 2) if ts else float("inf")
    figures = {
        "polls": len(polls),
        "failed": len(bad),
        "isolated_timeouts": len(isolated),
        "slowest_s": round(max((p.seconds for p in polls), default=0.0), 3),
        "max_gap_s": gaps,
        "examples": [
            {
                "t": round(p.t, 2),
                "replica": p.replica,
                "path": p.path,
                "status": p.status,
                "error": p.error,
            }
            for p in bad[:EXAMPLES]
        ],
    }
    if bad:
        return Verdict(
            "metrics_and_ready_up", False, f"{len(bad)} of {len(polls)} polls failed", figures
        )
    if any(g > MAX_POLL_GAP_S for g in gaps.values()):
        why = f"not polled throughout (a gap above {MAX_POLL_GAP_S:g} s): {gaps}"
        return Verdict("metrics_and_ready_up", False, why, figures)
    late = f" ({len(isolated)} alone past its timeout, answered next time)" if isolated else ""
    return Verdict("metrics_and_ready_up", True, f"{len(polls)} polls, all 200{late}", figures)


# -- 6. limits hold across replicas -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LimitsProbe:
    """A burst on one key. The gateway decides each request somewhere between its send and its
    answer, so the bucket refilled for at least ``window_min`` (last send to first answer) and
    at most ``window_max`` (first send to last answer) while the burst went on."""

    at: float
    sent: int
    admitted: int  # answered 200
    rate_limited: int  # 429 on the requests-per-minute budget
    concurrency_limited: int  # 429 on max_concurrent (uses no budget)
    other: Mapping[str, int]  # any other answer, by status
    elapsed: float  # first send to last send
    rpm: int
    window_min: float | None = None  # None: taken as ``elapsed``
    window_max: float | None = None
    # Of the probed key's admissions, those let through unchecked while the store missed its
    # timeout (failure_mode open; the gateways' degraded-admissions counter over the burst).
    degraded: int = 0

    def _refill(self, window: float | None) -> float:
        return self.rpm + (self.elapsed if window is None else window) * self.rpm / 60.0

    @property
    def expected(self) -> float:
        """The bucket's size plus what it refilled from the first send to the last."""
        return self._refill(self.elapsed)

    @property
    def bounds(self) -> tuple[float, float]:
        """Admitted at least / at most (within one): the bucket's size plus its refill over the
        shortest / longest window the decisions can have spanned."""
        return self._refill(self.window_min), self._refill(self.window_max)

    def holds(self) -> bool:
        """The bucket's decisions within its bounds. An admission the store never saw (fail
        open) spent nothing from the bucket: the checked ones alone must stay under the top."""
        low, high = self.bounds
        return low - 1.0 <= self.admitted and self.admitted - self.degraded <= high + 1.0

    def to_json(self) -> dict[str, Any]:
        low, high = self.bounds
        return {
            "at_s": round(self.at, 2),
            "sent": self.sent,
            "admitted": self.admitted,
            "rate_limited": self.rate_limited,
            "concurrency_limited": self.concurrency_limited,
            "degraded": self.degraded,
            "other": dict(self.other),
            "elapsed_s": round(self.elapsed, 3),
            "rpm": self.rpm,
            "expected": round(self.expected, 2),
            "expected_range": [round(low, 2), round(high, 2)],
        }


def check_limits(probes: Sequence[LimitsProbe]) -> Verdict:
    figures: dict[str, Any] = {"probes": [p.to_json() for p in probes]}
    if not probes:
        return Verdict("limits_hold_across_replicas", False, "no limits probe ran", figures)
    problems = []
    for p in probes:
        if p.other:
            problems.append(f"probe at {p.at:.0f} s: other answers {dict(p.other)}")
        elif not p.holds():
            problems.append(f"probe at {p.at:.0f} s: admitted {p.admitted}, {_expect(p)}")
    if problems:
        return Verdict("limits_hold_across_replicas", False, "; ".join(problems), figures)
    why = "; ".join(f"admitted {p.admitted} of {p.sent}, {_expect(p)}" for p in probes)
    return Verdict("limits_hold_across_replicas", True, why, figures)


def _expect(p: LimitsProbe) -> str:
    low, high = p.bounds
    unchecked = f", {p.degraded} admitted unchecked (store timed out)" if p.degraded else ""
    return (
        f"expected {low:.1f}-{high:.1f} +/- 1 (from first to last send: {p.expected:.1f})"
        f"{unchecked}"
    )


# -- 7. memory is flat -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemorySample:
    t: float
    replica: int
    rss: int
    series: int
    in_flight: float = 0.0
    prefix_index_bytes: float = 0.0


def check_memory(samples: Sequence[MemorySample], warm_until: float, replicas: int) -> Verdict:
    """After the warm-up, RSS grows by less than max(8 MiB, 10 %) and the series by little.

    The bound: CPython's allocator keeps freed arenas, so RSS rises in steps for a while even
    without a leak, and the prefix index fills towards its fixed capacity (bounded by design,
    about 10 MB at 50,000 hashes; its own estimate is reported beside RSS). A leak of a few
    hundred bytes per request over thousands of requests shows above the bound; the first
    quarter of the run (imports, pools, caches warming) is left out.
    """
    per: dict[str, Any] = {}
    problems = []
    for r in range(replicas):
        mine = sorted((s for s in samples if s.replica == r), key=lambda s: s.t)
        warm = next((s for s in mine if s.t >= warm_until), None)
        if not mine or warm is None:
            problems.append(f"replica {r}: no samples after the warm-up")
            continue
        start, end = mine[0], mine[-1]
        growth = end.rss - warm.rss
        bound = max(RSS_SLACK_BYTES, RSS_SLACK_SHARE * warm.rss)
        series_growth = end.series - warm.series
        per[str(r)] = {
            "rss_mb": {
                k: round(s.rss / MIB, 1)
                for k, s in (("start", start), ("warm", warm), ("end", end))
            },
            "rss_growth_mb": round(growth / MIB, 2),
            "rss_bound_mb": round(bound / MIB, 2),
            "series": {"start": start.series, "warm": warm.series, "end": end.series},
            "series_growth": series_growth,
            "prefix_index_mb": round(end.prefix_index_bytes / MIB, 2),
        }
        if growth >= bound:
            problems.append(
                f"replica {r}: RSS grew {growth / MIB:.1f} MiB after the warm-up "
                f"(bound {bound / MIB:.1f})"
            )
        if series_growth > SERIES_SLACK:
            problems.append(f"replica {r}: series grew by {series_growth} (bound {SERIES_SLACK})")
    figures = {"warm_until_s": round(warm_until, 1), "replicas": per, "series_bound": SERIES_SLACK}
    if problems:
        return Verdict("memory_flat", False, "; ".join(problems), figures)
    why = "; ".join(
        f"replica {r}: RSS +{v['rss_growth_mb']} MiB (< {v['rss_bound_mb']}), "
        f"series +{v['series_growth']}"
        for r, v in per.items()
    )
    return Verdict("memory_flat", True, why, figures)


# -- 8. every admin change, made through one replica, was applied by every replica ----------


@dataclass(frozen=True, slots=True)
class AdminChange:
    """One admin change the soak made through one replica (``through``), and the replicas
    that then showed its effect (``applied``)."""

    kind: str
    through: int
    status: int
    spread: str | None  # its answer's X-Gateway-Replicas
    applied: list[int]
    replicas: int

    @property
    def ok(self) -> bool:
        return self.status == 200 and len(self.applied) == self.replicas

    @property
    def problem(self) -> str:
        if self.status != 200:
            return f"refused through replica {self.through}: {self.status}"
        missing = sorted(set(range(self.replicas)) - set(self.applied))
        return f"not applied by replica(s) {missing}" if missing else ""

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "through": self.through,
            "status": self.status,
            "spread": self.spread,
            "applied": self.applied,
        }


def check_admin_changes(changes: Sequence[AdminChange], planned: int) -> Verdict:
    figures = {"planned": planned, "changes": [c.to_json() for c in changes]}
    if len(changes) < planned:
        why = f"{planned - len(changes)} of {planned} admin changes never made"
        return Verdict("admin_changes_everywhere", False, why, figures)
    bad = [f"{c.kind}: {c.problem}" for c in changes if not c.ok]
    if bad:
        return Verdict("admin_changes_everywhere", False, "; ".join(bad), figures)
    through = sorted({c.through for c in changes})
    return Verdict(
        "admin_changes_everywhere",
        True,
        f"all {len(changes)} changes, each made through one replica ({through}), "
        "applied by every replica",
        figures,
    )


# -- 9. every fault was injected; traces were exported ----------------------------------------


def check_faults(plan: Sequence[PlannedFault], windows: Sequence[FaultWindow]) -> Verdict:
    figures = {"planned": len(plan), "windows": [w.to_json() for w in windows]}
    failed = [w for w in windows if not w.ok]
    if len(windows) < len(plan):
        why = f"{len(plan) - len(windows)} of {len(plan)} faults never ran"
        return Verdict("faults_injected", False, why, figures)
    if failed:
        why = "; ".join(f"{w.kind} {w.target or ''}: {w.detail}" for w in failed)
        return Verdict("faults_injected", False, why, figures)
    return Verdict(
        "faults_injected", True, f"all {len(plan)} faults injected and recovered", figures
    )


def check_traces(exports: int) -> Verdict:
    figures = {"otlp_posts": exports}
    if exports <= 0:
        return Verdict("traces_exported", False, "the OTLP sink received nothing", figures)
    return Verdict("traces_exported", True, f"{exports} OTLP export requests received", figures)
