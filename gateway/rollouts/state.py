"""The fleet's rollouts, as every replica holds them: what each alias's rollout is doing, moved
only by changes from the fleet's log (``gateway.admin.actions``), so every replica holds the
same. Pure: each change is a function from one state to the next, refusing what cannot follow.

A rollout is ``running`` from its start; ``paused`` and ``running`` again at an operator's
word; it ends ``promoted`` (the canary is the alias's stable pool) or ``aborted`` (back to
stable, the canary pool drained). The driver's steps carry its lease's fencing token
(``gateway.fleet.lease``): a step from a driver older than one already heard is refused, and
so is a step that is not the next one, so a step is applied once, whoever drives.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

from gateway.fleet.figures import PoolCounts
from gateway.rollouts.gates import Gates
from gateway.rollouts.plan import DEFAULT_STEPS, Plan, PlanError

Status = Literal["running", "paused", "aborted", "promoted"]
# Each replica's cumulative counts of the rollout's pools when a step's window began: a window
# sums each replica's counts since its own (a replica that left takes its counts with it).
Baseline = Mapping[str, Mapping[str, PoolCounts]]
HISTORY: Final = 64  # events kept per rollout (the log keeps them all)
CONFIGURED_KEPT: Final = 16  # configured plans remembered per alias, as started
_GATE_FIELDS: Final = tuple(Gates.__dataclass_fields__)
_OPTIONAL_GATES: Final = frozenset({"ttft_p99_slo", "itl_p50_slo", "min_agreement"})
_PLAN_FIELDS: Final = frozenset(
    {"alias", "stable", "canary", "steps", "hold_s", "min_requests", "gates", "probes",
     "probe_tokens"}
)  # fmt: skip


class RolloutError(ValueError):
    """A rollout change that cannot follow the current state; the message says why."""


@dataclass(frozen=True, slots=True)
class RolloutEvent:
    """One thing that happened to a rollout: ``action`` is ``start``, ``advance``, ``promote``,
    ``abort``, ``pause`` or ``resume``; ``readings``: the gates' figures it was decided on."""

    at: float
    step: int  # an index into the plan's steps (0 the first): ``Plan.step_name`` for people
    action: str
    why: str = ""
    by: str = ""  # "driver <token>" or the operator's caller
    readings: tuple[dict[str, Any], ...] = ()

    def doc(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "step": self.step,
            "action": self.action,
            "why": self.why,
            "by": self.by,
            "readings": list(self.readings),
        }

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> RolloutEvent:
        return cls(
            at=float(doc["at"]),
            step=int(doc["step"]),
            action=str(doc["action"]),
            why=str(doc.get("why", "")),
            by=str(doc.get("by", "")),
            readings=tuple(dict(r) for r in doc.get("readings", ())),
        )


@dataclass(frozen=True, slots=True)
class Run:
    """One alias's rollout."""

    plan: Plan
    status: Status
    step: int  # an index into the plan's steps
    step_began: float  # Unix time (of the change that began it)
    token: int = 0  # the highest driver token heard
    history: tuple[RolloutEvent, ...] = ()
    # Each replica's counts of both pools when the step's window began (None: not yet taken)
    baseline: Baseline | None = None

    @property
    def weights(self) -> dict[str, float]:
        """The alias's weights this rollout sets now."""
        if self.status == "promoted":
            return self.plan.promoted()
        if self.status == "aborted":
            return self.plan.rolled_back()
        return self.plan.weights(self.step)

    @property
    def active(self) -> bool:
        return self.status in ("running", "paused")

    def _then(self, event: RolloutEvent, **changes: Any) -> Run:
        return replace(self, history=(*self.history, event)[-HISTORY:], **changes)

    def doc(self) -> dict[str, Any]:
        return {
            "plan": plan_doc(self.plan),
            "status": self.status,
            "step": self.step,
            "share": self.plan.steps[self.step],
            "step_began": self.step_began,
            "token": self.token,
            "weights": self.weights,
            "history": [e.doc() for e in self.history],
            "baseline": None if self.baseline is None else baseline_doc(self.baseline),
        }

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> Run:
        status = str(doc["status"])
        if status not in ("running", "paused", "aborted", "promoted"):
            raise ValueError(f"no such status {status!r}")
        return cls(
            plan=parse_plan(doc["plan"]),
            status=status,  # type: ignore[arg-type]
            step=int(doc["step"]),
            step_began=float(doc["step_began"]),
            token=int(doc.get("token", 0)),
            history=tuple(RolloutEvent.parse(e) for e in doc.get("history", ())),
            baseline=parse_baseline(doc.get("baseline")),
        )


def baseline_doc(baseline: Baseline) -> dict[str, dict[str, Any]]:
    return {
        replica: {pool: c.doc() for pool, c in pools.items()} for replica, pools in baseline.items()
    }


def parse_baseline(doc: Any) -> Baseline | None:
    if doc is None:
        return None
    if not isinstance(doc, Mapping) or not all(isinstance(p, Mapping) for p in doc.values()):
        raise ValueError("a baseline is an object of replica: {pool: counts}")
    return {
        str(replica): {str(pool): PoolCounts.parse(c) for pool, c in pools.items()}
        for replica, pools in doc.items()
    }


def plan_doc(plan: Plan) -> dict[str, Any]:
    gates = plan.gates
    return {
        "alias": plan.alias,
        "stable": plan.stable,
        "canary": plan.canary,
        "steps": list(plan.steps),
        "hold_s": plan.hold_s,
        "min_requests": plan.min_requests,
        "gates": {name: getattr(gates, name) for name in _GATE_FIELDS},
        "probes": list(plan.probes),
        "probe_tokens": plan.probe_tokens,
    }


def parse_plan(doc: Any, alias: str | None = None) -> Plan:
    """A plan from its JSON (``alias``: the one the path names, which the body may omit);
    ``PlanError`` saying what is wrong with it."""
    if not isinstance(doc, Mapping):
        raise PlanError("a rollout's plan is a JSON object")
    unknown = sorted(set(doc) - _PLAN_FIELDS)
    if unknown:
        raise PlanError(f"unknown field(s): {', '.join(unknown)}")
    gates_doc = doc.get("gates", {})
    if not isinstance(gates_doc, Mapping) or set(gates_doc) - set(_GATE_FIELDS):
        raise PlanError(f"gates: an object of {', '.join(_GATE_FIELDS)}")
    named = doc.get("alias", alias)
    if alias is not None and named != alias:
        raise PlanError(f"the plan is for {named!r}, not {alias!r}")
    try:
        given: dict[str, Any] = {
            k: None if v is None and k in _OPTIONAL_GATES else _number(v, k)
            for k, v in gates_doc.items()
        }
        gates = Gates(**given)
        return Plan(
            alias=_text(named, "alias"),
            stable=_text(doc.get("stable"), "stable"),
            canary=_text(doc.get("canary"), "canary"),
            steps=tuple(
                _number(s, "steps") for s in _list(doc.get("steps", DEFAULT_STEPS), "steps")
            ),
            hold_s=_number(doc.get("hold_s", 300.0), "hold_s"),
            min_requests=_whole(doc.get("min_requests", 100), "min_requests"),
            gates=gates,
            probes=tuple(_prompt(p) for p in _list(doc.get("probes", []), "probes")),
            probe_tokens=_whole(doc.get("probe_tokens", 16), "probe_tokens"),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, PlanError):
            raise
        raise PlanError(f"a plan's numbers must be numbers: {exc}") from None


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise PlanError(f"{name} must be a list")
    return list(value)


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlanError(f"{name} must be a number")
    return float(value)


def _prompt(value: Any) -> str:
    if not isinstance(value, str):
        raise PlanError("probes must be prompts (strings)")
    return value


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise PlanError(f"{name} must be a pool's (or alias's) name")
    return value


def _whole(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{name} must be a whole number")
    return value


def plan_fingerprint(plan: Plan) -> str:
    """What tells one plan from another (a plan of the configuration file, started once)."""
    canonical = json.dumps(plan_doc(plan), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Rollouts:
    """Every alias's rollout (the last one, while it is kept), as the log made them, and the
    configuration file's plans started for each alias (their fingerprints, the last
    ``CONFIGURED_KEPT``): each started once, whichever replica's file names it."""

    runs: Mapping[str, Run] = field(default_factory=dict)
    configured: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def get(self, alias: str) -> Run | None:
        return self.runs.get(alias)

    def active(self) -> list[Run]:
        return [r for r in self.runs.values() if r.active]

    def _with(self, run: Run) -> Rollouts:
        return replace(self, runs={**self.runs, run.plan.alias: run})

    def _running(self, alias: str, *, paused_too: bool = False) -> Run:
        run = self.runs.get(alias)
        if run is None or not run.active:
            raise RolloutError(f"No rollout of {alias!r} is under way.")
        if run.status == "paused" and not paused_too:
            raise RolloutError(f"The rollout of {alias!r} is paused.")
        return run

    def start(self, plan: Plan, at: float, by: str = "", *, configured: bool = False) -> Rollouts:
        """``configured``: the configuration file's plan, started once (refused if it was)."""
        run = self.runs.get(plan.alias)
        if run is not None and run.active:
            raise RolloutError(f"A rollout of {plan.alias!r} is under way already.")
        started = self._with(Run(plan, "running", 0, at, 0, (RolloutEvent(at, 0, "start", by=by),)))
        if not configured:
            return started
        fingerprint, before = plan_fingerprint(plan), self.configured.get(plan.alias, ())
        if fingerprint in before:
            raise RolloutError(f"The configured rollout of {plan.alias!r} was started already.")
        kept = (*before, fingerprint)[-CONFIGURED_KEPT:]
        return replace(started, configured={**self.configured, plan.alias: kept})

    def unstarted(self, plan: Plan) -> bool:
        """Whether ``plan`` (the configuration file's) is to be started now: not started yet,
        and no other rollout of its alias under way."""
        run = self.runs.get(plan.alias)
        started = plan_fingerprint(plan) in self.configured.get(plan.alias, ())
        return not started and (run is None or not run.active)

    def advance(
        self,
        alias: str,
        to: int,
        at: float,
        *,
        token: int,
        why: str = "",
        readings: tuple[dict[str, Any], ...] = (),
        baseline: Baseline | None = None,
    ) -> Rollouts:
        """The next step; ``baseline``: the fleet's counts as it begins (its window's start)."""
        run = self._check_driver(alias, token)
        if to != run.step + 1 or to >= len(run.plan.steps):
            raise RolloutError(
                f"Step {to + 1} does not follow {run.plan.step_name(run.step)} of {alias!r}'s"
                " rollout."
            )
        event = RolloutEvent(at, to, "advance", why, f"driver {token}", readings)
        changed = run._then(event, step=to, step_began=at, token=token, baseline=baseline)
        return self._with(changed)

    def window(self, alias: str, step: int, *, token: int, baseline: Baseline) -> Rollouts:
        """The window of ``step`` begins now (its first driver's counts): once a step."""
        run = self._check_driver(alias, token, paused_too=True)
        if step != run.step or run.baseline is not None:
            raise RolloutError(
                f"Step {step + 1}'s window of {alias!r}'s rollout is set already (it is at"
                f" {run.plan.step_name(run.step)})."
            )
        return self._with(replace(run, baseline=dict(baseline), token=token))

    def promote(
        self,
        alias: str,
        at: float,
        *,
        token: int,
        why: str = "",
        readings: tuple[dict[str, Any], ...] = (),
    ) -> Rollouts:
        run = self._check_driver(alias, token)
        if run.step != len(run.plan.steps) - 1:
            raise RolloutError(
                f"{alias!r}'s rollout is at {run.plan.step_name(run.step)}, not its last."
            )
        event = RolloutEvent(at, run.step, "promote", why, f"driver {token}", readings)
        return self._with(run._then(event, status="promoted", token=token))

    def abort(
        self,
        alias: str,
        at: float,
        why: str,
        readings: tuple[dict[str, Any], ...] = (),
        *,
        token: int | None = None,
        by: str = "",
    ) -> Rollouts:
        """Back to stable: by the driver (a gate failed: ``token``) or an operator."""
        if token is None:
            run = self._running(alias, paused_too=True)
        else:
            run = self._check_driver(alias, token, paused_too=True)
        by = f"driver {token}" if token is not None else by
        event = RolloutEvent(at, run.step, "abort", why, by, readings)
        return self._with(run._then(event, status="aborted", token=max(run.token, token or 0)))

    def pause(self, alias: str, at: float, by: str = "") -> Rollouts:
        run = self._running(alias)
        return self._with(run._then(RolloutEvent(at, run.step, "pause", by=by), status="paused"))

    def resume(self, alias: str, at: float, by: str = "") -> Rollouts:
        run = self._running(alias, paused_too=True)
        if run.status != "paused":
            raise RolloutError(f"The rollout of {alias!r} is not paused.")
        return self._with(run._then(RolloutEvent(at, run.step, "resume", by=by), status="running"))

    def _check_driver(self, alias: str, token: int, *, paused_too: bool = False) -> Run:
        run = self._running(alias, paused_too=paused_too)
        if token < run.token:
            raise RolloutError(
                f"A driver with token {token} was succeeded (token {run.token}) for {alias!r}."
            )
        return run

    def doc(self) -> dict[str, Any]:
        """The runs, alias -> run (the configured plans apart: ``configured_doc``, so that a
        replica of the version before them still reads a snapshot)."""
        return {alias: run.doc() for alias, run in sorted(self.runs.items())}

    def configured_doc(self) -> dict[str, list[str]]:
        return {alias: list(f) for alias, f in sorted(self.configured.items())}

    @classmethod
    def parse(cls, doc: Any, configured: Any = None) -> Rollouts:
        runs = doc if isinstance(doc, Mapping) else {}
        started = configured if isinstance(configured, Mapping) else {}
        return cls(
            {str(alias): Run.parse(run) for alias, run in runs.items()},
            {str(alias): tuple(str(x) for x in f) for alias, f in started.items()},
        )


class RolloutBook:
    """A replica's rollouts: the value the log's changes replace (``now``), in one place the
    admin actions, the driver and the views read."""

    __slots__ = ("now",)

    def __init__(self, now: Rollouts | None = None) -> None:
        self.now = now or Rollouts()
