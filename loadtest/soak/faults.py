"""What goes wrong during a soak, and when. Pure: a duration in, a schedule out.

Every fault is placed at a fraction of a *cycle*, so a short run (one cycle) gets each of them
once and a long one repeats the cycle (one per ~5 minutes). Backend faults touch one backend at
a time: kills, hangs and error bursts the stable pool (gpu-a, gpu-b), alternating, so that at
any moment every route keeps a healthy backend; the canary pool's only backend (gpu-canary) is
marked down by its probes (``down``: its ``/health`` answers 503 while it keeps serving), and
the alias must then pass its share to the stable pool. It is never killed or hung: a request
already routed to a pool whose only backend dies before answering cannot move to another pool
(future work), so that would say nothing about what the gateway can save today.

Redis, the fleet's change log and the limits' store, is paused (SIGSTOP, ``redis_pause``) and
killed then started again empty (``redis_kill``), with admin changes made around and during
each (``loadtest.soak.redis_faults``). A Redis fault is never near a backend fault or a limits
probe, which would then measure fail-open admissions.

After a run, the faults' recorded ``FaultWindow``s answer the questions the invariants ask:
which backends were healthy at a time, was a backend being killed, was an error burst on.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

FaultKind = Literal[
    "kill",  # SIGKILL a backend, restart it on its port after `hold` seconds
    "hang",  # hang_before_first_byte + unhealthy for `hold` seconds
    "down",  # unhealthy (its probes fail, it still serves) for `hold` seconds
    "error_burst",  # error_rate / error_status with revert_after = `hold`
    "redis_kill",  # SIGKILL Redis, restart it empty after `hold` seconds; changes around it
    "redis_pause",  # SIGSTOP Redis for `hold` seconds, admin changes sent meanwhile
    "reload",  # rewrite the TOML with other alias weights, POST /admin/reload
    "policy",  # PUT /admin/policy
    "canary_shift",  # PUT /admin/aliases/chat
    "canary_rollback",  # POST /admin/aliases/chat/rollback
    "limits_probe",  # a burst on the internal-tools key (its bucket idle for 60 s)
]
BACKEND_FAULTS: Final = frozenset({"kill", "hang", "down", "error_burst"})
REDIS_FAULTS: Final = frozenset({"redis_kill", "redis_pause"})
STABLE: Final = ("gpu-a", "gpu-b")
CANARY: Final = "gpu-canary"
CYCLE_TARGET_S: Final = 300.0  # a long run repeats the cycle about this often
KILL_HOLD_S: Final = 3.0
# Longer than an admin change's wait for Redis (1.5 x fleet.log_timeout, 3 s): the changes sent
# at its start are answered within it. Shorter than fleet.report_ttl (6 s), so that the
# replicas' reports in Redis outlive it (a longer pause is another fault: replicas dropping out).
PAUSE_HOLD_S: Final = 5.0
PROBE_IDLE_S: Final = 65.0  # the probed key is left alone this long before (bucket refilled)
PROBE_MAX_S: Final = 30.0  # ... and until the probe is over (it takes a few seconds)
ERROR_BURST: Final = {"error_rate": 0.8, "error_status": 503}
HANG: Final = {"hang_before_first_byte": True, "unhealthy": True}
DOWN: Final = {"unhealthy": True}
CANARY_SHIFT: Final = {"stable": 50, "canary": 50}
RELOAD_WEIGHTS: Final = ({"stable": 80, "canary": 20}, {"stable": 95, "canary": 5})
LEAST_LOAD: Final = {"policy": "least_load", "weights": {"active": 1.0, "queue": 4.0, "kv": 0.5}}
PREFIX_AFFINITY: Final = {
    "policy": "prefix_affinity",
    "weights": {"active": 2.0, "queue": 3.0, "kv": 1.0},
}
# the kinds that are admin changes (made through one replica; ``admin_changes_everywhere``)
ADMIN_KINDS: Final = frozenset({"reload", "policy", "canary_shift", "canary_rollback"})


@dataclass(frozen=True, slots=True)
class PlannedFault:
    at: float  # seconds since the load started
    kind: FaultKind
    target: str | None = None  # the backend, for backend faults
    hold: float = 0.0  # how long the fault stays on
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.target}" if self.target else self.kind


# Fractions of a cycle: (fraction, kind, which stable backend (0/1, swapped on odd cycles)).
_CYCLE: Final[tuple[tuple[float, FaultKind, int | None], ...]] = (
    (0.0, "limits_probe", None),
    (0.08, "kill", 0),
    (0.22, "hang", 1),
    (0.34, "reload", None),
    (0.40, "error_burst", 0),
    (0.48, "policy", None),
    (0.56, "redis_kill", None),
    (0.64, "canary_shift", None),
    (0.68, "down", None),  # the canary (CANARY)
    (0.72, "policy", None),
    (0.79, "redis_pause", None),  # between the canary's probes failing and the last kill
    (0.80, "canary_rollback", None),
    (0.88, "kill", 1),
)


def cycles(duration: float) -> int:
    return max(1, round(duration / CYCLE_TARGET_S))


def plan_faults(duration: float) -> tuple[PlannedFault, ...]:
    """The run's faults, in time order."""
    if duration <= 0:
        raise ValueError("duration must be positive")
    n = cycles(duration)
    length = duration / n
    burst = max(5.0, 0.06 * length)
    out: list[PlannedFault] = []
    for c in range(n):
        start = c * length
        policies = iter((LEAST_LOAD, PREFIX_AFFINITY))
        for frac, kind, which in _CYCLE:
            at = start + frac * length
            target = None if which is None else STABLE[(which + c) % 2]
            if kind == "kill":
                out.append(PlannedFault(at, kind, target, KILL_HOLD_S))
            elif kind == "hang":
                out.append(PlannedFault(at, kind, target, burst, HANG))
            elif kind == "down":
                out.append(PlannedFault(at, kind, CANARY, burst, DOWN))
            elif kind == "error_burst":
                out.append(PlannedFault(at, kind, target, burst, ERROR_BURST))
            elif kind in REDIS_FAULTS:
                hold = PAUSE_HOLD_S if kind == "redis_pause" else max(3.0, 0.04 * length)
                out.append(PlannedFault(at, kind, hold=hold))
            elif kind == "reload":
                weights = RELOAD_WEIGHTS[c % 2]
                out.append(PlannedFault(at, kind, params={"aliases": {"chat": weights}}))
            elif kind == "policy":
                out.append(PlannedFault(at, kind, params=next(policies)))
            elif kind == "canary_shift":
                out.append(PlannedFault(at, kind, params={"chat": CANARY_SHIFT}))
            else:
                out.append(PlannedFault(at, kind))
    return tuple(out)


def overlapping(plan: Sequence[PlannedFault], margin: float = 5.0) -> list[tuple[str, str]]:
    """Pairs of backend faults (and Redis faults) closer than ``margin`` s: there must be none.

    A fault's own span is ``hold`` plus recovery, which ``margin`` stands for.
    """
    spans = [
        (f.at, f.at + f.hold + margin, f.label)
        for f in plan
        if f.kind in BACKEND_FAULTS or f.kind in REDIS_FAULTS
    ]
    spans.sort()
    return [(a[2], b[2]) for a, b in itertools.pairwise(spans) if b[0] < a[1]]


def probe_times(plan: Iterable[PlannedFault]) -> list[float]:
    return [f.at for f in plan if f.kind == "limits_probe"]


def probed_key_quiet(t: float, probes: Sequence[float]) -> bool:
    """Whether the probed key must not be used at ``t`` (its bucket must be full for a probe)."""
    return any(p - PROBE_IDLE_S <= t < p + PROBE_MAX_S for p in probes)


@dataclass(frozen=True, slots=True)
class FaultWindow:
    """A fault as it happened: from ``start`` until it was over (recovered) at ``end``."""

    kind: FaultKind
    target: str | None
    start: float
    end: float
    ok: bool = True  # injected and recovered as planned
    detail: str = ""

    def covers(self, t: float, slack: float = 0.0) -> bool:
        return self.start - slack <= t <= self.end + slack

    def overlaps(self, start: float, end: float, slack: float = 0.0) -> bool:
        """Whether the fault was on at some time in [start, end] (give or take ``slack``)."""
        return self.start - slack <= end and start <= self.end + slack

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "target": self.target,
            "start_s": round(self.start, 3),
            "end_s": round(self.end, 3),
            "ok": self.ok,
            "detail": self.detail,
        }


def faulty_backends_at(windows: Iterable[FaultWindow], t: float, slack: float = 0.0) -> set[str]:
    """Backends a kill, hang or error burst affected at ``t`` (give or take ``slack``)."""
    return {
        w.target
        for w in windows
        if w.kind in BACKEND_FAULTS and w.target is not None and w.covers(t, slack)
    }


def healthy_backends_at(
    windows: Iterable[FaultWindow], backends: Iterable[str], t: float, slack: float = 0.0
) -> set[str]:
    return set(backends) - faulty_backends_at(windows, t, slack)


def during(
    windows: Iterable[FaultWindow], kinds: Iterable[str], t: float, slack: float = 0.0
) -> bool:
    """Whether a fault of one of ``kinds`` was on at ``t`` (give or take ``slack``)."""
    wanted = set(kinds)
    return any(w.kind in wanted and w.covers(t, slack) for w in windows)
