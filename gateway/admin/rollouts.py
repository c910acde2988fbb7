"""The admin changes of progressive rollouts (``gateway.rollouts``), rows of the table of
changes (``gateway.admin.actions``): applied the same way on every replica, from the log.

- ``POST /admin/rollouts/{alias}``: start one (the body is its plan); the alias goes to the
  plan's first step at once, the canary pool undrained.
- ``POST /admin/rollouts/{alias}/pause``, ``/resume``: hold it where it is, go on.
- ``POST /admin/rollouts/{alias}/abort``: back to stable, the canary pool drained (a body
  ``{"why": ...}`` says why).
- ``POST /admin/rollouts/{alias}/decision``: the driver's (``gateway.rollouts.driver``), not
  routed: a step's window begun (``window``, the fleet's counts then), ``advance``,
  ``promote`` or ``abort``, with the gates' figures, under its lease's token.
- ``POST /admin/rollouts/{alias}/configured``: the driver's too, not routed: the
  configuration file's plan (``[rollout.plans.<alias>]``) started, once for the fleet.

Times come in the body, stamped where the change was made (``prepare``), and an operator's
change is recorded ``by`` its caller (the audit trail's), so every replica records the same.
A change that cannot follow the rollout's state is refused (409) and changes nothing.

A rollout is one change of its alias's weights: the alias's ``previous`` (what
``POST /admin/aliases/{alias}/rollback`` goes back to) is the split before it started, kept
through its steps, its promotion or its abort.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import structlog
from aiohttp import web

from backends.errors import Conflict, InvalidRequest, NotFound
from gateway.admin.action import CALLER, Action, Doc, Params
from gateway.admin.context import admin_of
from gateway.admin.own import submit_own
from gateway.request.services import Services
from gateway.rollouts.plan import Plan, PlanError
from gateway.rollouts.state import (
    RolloutError,
    Rollouts,
    Run,
    parse_baseline,
    parse_plan,
    plan_doc,
)

log = structlog.get_logger("gateway.rollouts")

DECISION_PATH: Final = "/admin/rollouts/{alias}/decision"
_ACTIONS: Final = ("window", "advance", "promote", "abort")


def _stamped(_svc: Services, _params: Params, body: Doc) -> tuple[Doc, dict[str, Any]]:
    body = dict(body) if isinstance(body, dict) else {}
    body["at"] = time.time()
    return body, {}


def _at(body: Doc) -> float:
    at = body.get("at") if isinstance(body, dict) else None
    return float(at) if isinstance(at, int | float) and not isinstance(at, bool) else time.time()


def _after(svc: Services, change: Any) -> Rollouts:
    """The rollouts once ``change`` (a function of the current ones) is made; 409 if it
    cannot follow them."""
    try:
        after: Rollouts = change(svc.rollouts.now)
    except RolloutError as exc:
        raise Conflict(str(exc)) from None
    return after


def _by(params: Params) -> str:
    """Who made an operator's change (the audit trail's caller)."""
    return params.get(CALLER, "")


def _set(svc: Services, alias: str, after: Rollouts) -> dict[str, Any]:
    """Make ``after`` the rollouts, and the alias's weights and the canary's drain theirs.
    Only the change that starts a rollout makes the weights before it the alias's previous."""
    run = after.get(alias)
    assert run is not None
    rollout = svc.rollout
    before = svc.rollouts.now.get(alias)
    starts = before is None or not before.active
    svc.rollouts.now = after
    svc.metrics.rollout_share.labels(alias).set(run.weights.get(run.plan.canary, 0.0))
    canary = run.plan.canary
    if run.status == "aborted":
        rollout.set_weights(alias, run.weights, undoable=False)
        try:
            rollout.set_drained(canary, True)  # until someone acts
        except InvalidRequest as exc:  # another alias has only the canary left: it stays
            log.warning("rollout_canary_kept", alias=alias, pool=canary, why=exc.message)
    else:
        if canary in rollout.drained:
            rollout.set_drained(canary, False)
        rollout.set_weights(alias, run.weights, undoable=starts)
    return run.doc()


def not_under_way(svc: Services, alias: str) -> None:
    """``Conflict`` while a rollout of ``alias`` is under way: it moves the weights itself (a
    rollback would leave it judging a canary with no traffic); aborting it goes back."""
    run = svc.rollouts.now.get(alias)
    if run is not None and run.active:
        raise Conflict(
            f"A rollout of {alias!r} is under way; abort it (POST /admin/rollouts/{alias}/abort)"
            f" to go back to {run.plan.stable!r}."
        )


def _plan(svc: Services, params: Params, body: Doc) -> Any:
    alias = params["alias"]
    rollout = svc.rollout
    if alias not in rollout.aliases:
        raise NotFound(f"No alias {alias!r}.")
    doc = {k: v for k, v in body.items() if k != "at"} if isinstance(body, dict) else body
    try:
        return parse_plan(doc, alias).check(rollout.pools)
    except PlanError as exc:
        raise InvalidRequest(f"Invalid rollout plan for {alias!r}: {exc}.") from None


def _start_check(svc: Services, params: Params, body: Doc) -> Doc:
    plan = _plan(svc, params, body)
    _after(svc, lambda r: r.start(plan, _at(body)))
    return {"step": 0, "weights": plan.weights(0)}


def _start(svc: Services, params: Params, body: Doc) -> Doc:
    plan = _plan(svc, params, body)
    return _set(svc, params["alias"], _after(svc, lambda r: r.start(plan, _at(body), _by(params))))


def _configured(svc: Services, params: Params, body: Doc) -> Rollouts:
    plan = _plan(svc, params, body)
    return _after(svc, lambda r: r.start(plan, _at(body), "configuration", configured=True))


def _before(svc: Services, params: Params) -> Doc:
    run = svc.rollouts.now.get(params["alias"])
    return None if run is None else {"status": run.status, "step": run.step}


def _operator(verb: str) -> Action:
    def change(svc: Services, params: Params, body: Doc) -> Rollouts:
        alias, at, by = params["alias"], _at(body), _by(params)
        why = str(body.get("why", "")) if isinstance(body, dict) else ""
        if verb == "pause":
            return _after(svc, lambda r: r.pause(alias, at, by))
        if verb == "resume":
            return _after(svc, lambda r: r.resume(alias, at, by))
        return _after(svc, lambda r: r.abort(alias, at, why or "aborted by an operator", by=by))

    check, apply = _made(change)
    return Action(
        "POST",
        f"/admin/rollouts/{{alias}}/{verb}",
        check,
        apply,
        _before,
        json_body=True,  # the time it was made, stamped by ``prepare``; ``why`` for an abort
        prepare=_stamped,
    )


def _decided(svc: Services, params: Params, body: Doc) -> Rollouts:
    if not isinstance(body, dict) or body.get("action") not in _ACTIONS:
        raise InvalidRequest(f"A decision is one of {', '.join(_ACTIONS)}.")
    alias, at, action = params["alias"], _at(body), body["action"]
    try:
        token = int(body["token"])
        why = str(body.get("why", ""))
        readings = tuple(dict(r) for r in body.get("readings", ()))
        to = int(body.get("step", -1))
        baseline = parse_baseline(body.get("baseline"))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise InvalidRequest(
            "A decision has a token, readings and a baseline as objects."
        ) from None
    if action == "window":
        if baseline is None:
            raise InvalidRequest("A window decision has a baseline.")
        return _after(svc, lambda r: r.window(alias, to, token=token, baseline=baseline))
    if action == "advance":
        return _after(
            svc,
            lambda r: r.advance(
                alias, to, at, token=token, why=why, readings=readings, baseline=baseline
            ),
        )
    if action == "promote":
        return _after(svc, lambda r: r.promote(alias, at, token=token, why=why, readings=readings))
    return _after(svc, lambda r: r.abort(alias, at, why, readings, token=token))


Making = Callable[[Services, Params, Doc], Rollouts]  # the rollouts a change makes
Made = Callable[[Services, Params, Doc], Doc]


def _made(change: Making) -> tuple[Made, Made]:
    """An action's check (what it would set) and apply, from the rollouts it makes."""

    def check(svc: Services, params: Params, body: Doc) -> Doc:
        run = change(svc, params, body).get(params["alias"])
        assert run is not None
        return {"status": run.status, "step": run.step}

    def apply(svc: Services, params: Params, body: Doc) -> Doc:
        return _set(svc, params["alias"], change(svc, params, body))

    return check, apply


_decision_check, _decision = _made(_decided)
_configured_check, _configured_apply = _made(_configured)


# The driver's (not routed: only the gateway appends it)
DECISION: Final = Action(
    "POST", DECISION_PATH, _decision_check, _decision, _before, json_body=True, routed=False
)
# The configuration file's plan, started once for the fleet by the replica holding its lease
CONFIGURED: Final = Action(
    "POST",
    "/admin/rollouts/{alias}/configured",
    _configured_check,
    _configured_apply,
    _before,
    json_body=True,
    routed=False,
)
ROLLOUT_ACTIONS: Final = (
    Action(
        "POST",
        "/admin/rollouts/{alias}",
        _start_check,
        _start,
        _before,
        json_body=True,
        prepare=_stamped,
    ),
    _operator("pause"),
    _operator("resume"),
    _operator("abort"),
    DECISION,
    CONFIGURED,
)


def state(svc: Services) -> dict[str, Any]:
    """The rollouts, for a snapshot of the fleet's log (two of its sections: ``rollouts``
    and ``rollouts_configured``)."""
    now = svc.rollouts.now
    return {"rollouts": now.doc(), "rollouts_configured": now.configured_doc()}


def restore(svc: Services, doc: Mapping[str, Any]) -> None:
    svc.rollouts.now = Rollouts.parse(doc.get("rollouts"), doc.get("rollouts_configured"))


async def submit_decision(svc: Services, alias: str, body: dict[str, Any]) -> None:
    """The driver's decision for ``alias`` made for the fleet (``_submit``)."""
    await _submit(svc, DECISION, alias, body, "rollout driver")


async def start_configured(svc: Services, plan: Plan) -> None:
    """The configuration file's plan started for the fleet, once (``_submit``)."""
    await _submit(svc, CONFIGURED, plan.alias, plan_doc(plan), "configuration")


async def _submit(
    svc: Services, action: Action, alias: str, body: dict[str, Any], caller: str
) -> None:
    """A change the gateway makes (``action``, not routed) for the fleet (``submit_own``)."""
    await submit_own(svc, action, {"alias": alias}, body, caller)


Look = tuple[str, dict[str, Any]]  # the replica driving a rollout, and its last look


async def _looks(request: web.Request) -> tuple[str, dict[str, Look], dict[str, Any]]:
    """This replica's id, and each rollout's driver's last look: this replica's own where it
    drives, else from the fleet's reports (the newest, should two claim one while the lease
    passes; ``fleet.report_interval`` old at most; the last known, marked stale, while the
    registry is out of reach: the third part, the mark)."""
    admin = admin_of(request)
    svc = admin.svc
    member = svc.fleet
    me = "self" if member is None else member.id
    looks: dict[str, Look] = {}
    stale: dict[str, Any] = {}
    if member is not None:

        async def fetch() -> dict[str, Any]:
            reports = await member.registry.replicas()
            seen: dict[str, Look] = {}
            for report in sorted(reports, key=lambda r: r.reported_at):
                for alias, look in report.driving.items():
                    seen[alias] = (report.id, look)
            return {"looks": {a: list(v) for a, v in seen.items()}}

        doc = await admin.views.read("rollouts", fetch, lambda: {"looks": {}})
        looks = {a: (str(v[0]), dict(v[1])) for a, v in doc["looks"].items()}
        stale = {"stale": doc["stale"]} if "stale" in doc else {}
    looks.update((alias, (me, look)) for alias, look in svc.driver.progress.items())
    return me, looks, stale


def view(run: Run, alias: str, me: str, look: Look | None, now: float) -> dict[str, Any]:
    """A rollout as ``GET /admin/rollouts[/{alias}]`` shows it: its record and, while it is
    under way, its driver's last look (the gates' figures, the hold left, why), with its age."""
    by = None if look is None or not run.active else look[0]
    doc = {"alias": alias, **run.doc(), "driven_by": by, "driven_here": by == me}
    if look is not None and run.active:
        seen = dict(look[1])
        age = max(0.0, now - float(seen.pop("at", now)))
        left = max(0.0, float(seen.get("hold_left_s", 0.0)) - age)
        doc["now"] = {**seen, "hold_left_s": round(left, 3), "age_s": round(age, 3)}
    return doc


async def list_rollouts(request: web.Request) -> web.Response:
    """``GET /admin/rollouts``: every alias's rollout (the last one of each)."""
    svc = admin_of(request).svc
    runs = svc.rollouts.now.runs
    me, looks, stale = await _looks(request)
    now = time.time()
    docs = [view(runs[a], a, me, looks.get(a), now) for a in sorted(runs)]
    return web.json_response({"rollouts": docs, **stale})


async def get_rollout(request: web.Request) -> web.Response:
    """``GET /admin/rollouts/{alias}``."""
    svc, alias = admin_of(request).svc, request.match_info["alias"]
    run = svc.rollouts.now.get(alias)
    if run is None:
        raise NotFound(f"No rollout of {alias!r}.")
    me, looks, stale = await _looks(request)
    return web.json_response({**view(run, alias, me, looks.get(alias), time.time()), **stale})
