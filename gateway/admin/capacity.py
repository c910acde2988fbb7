"""The admin changes of capacity (``gateway.capacity``), rows of the table of changes
(``gateway.admin.actions``): applied the same way on every replica, from the log.

- ``POST /admin/backends/{backend_id}/sleep``: the fleet wants the engine asleep: no new
  requests from now on; the capacity manager puts it to sleep once it has finished what it
  has (by hand, or the manager's own decision: then with its lease's ``token`` in the body,
  refused if a newer manager decides since).
- ``POST /admin/backends/{backend_id}/wake``: wanted awake again; the manager (or the replica
  that made the change) calls its ``/wake_up``, and requests go to it once it says it is awake.
- ``PUT /admin/capacity/{model}``: the model's rule (its fields, over the current rule or the
  defaults); ``DELETE``: the model no longer managed, its engines wanted awake.
- ``GET /admin/capacity``: the rules, each engine's state (and for how long), the manager's
  last look.

A manager's decision is logged with the manager's reason (``why``) and token; an operator's
with its caller, as every change.
"""

from __future__ import annotations

from typing import Any, Final

import structlog
from aiohttp import web
from pydantic import ValidationError

from backends.errors import InvalidRequest, NotFound
from backends.sleep import Rest
from gateway.admin.action import CALLER, Action, Doc, Params
from gateway.admin.context import admin_of
from gateway.admin.own import submit_own
from gateway.capacity.settings import RULE_FIELDS, RuleSettings, rule_doc, rule_of
from gateway.request.services import Services

log = structlog.get_logger("gateway.capacity")


def _engine(svc: Services, params: Params) -> Any:
    b = svc.pool.get(params["backend_id"])
    if b is None:
        raise NotFound(f"No backend {params['backend_id']!r}.")
    return b


def _token(body: Doc) -> int | None:
    token = body.get("token") if isinstance(body, dict) else None
    if token is None:
        return None
    if not isinstance(token, int) or isinstance(token, bool):
        raise InvalidRequest("token: the capacity manager's fencing token, an integer.")
    return token


def _why(body: Doc) -> str | None:
    why = body.get("why") if isinstance(body, dict) else None
    return str(why)[:300] if why is not None else None


def engine_doc(b: Any) -> dict[str, Any]:
    return {
        "backend": b.id,
        "state": b.rest.value,
        "sleep_wanted": b.sleep_wanted,
        "asleep": b.asleep,
        "in_flight": b.in_flight,
        "models": sorted(b.models),
    }


def _sleep(wanted: bool) -> Action:
    def check(svc: Services, params: Params, body: Doc) -> Doc:
        _engine(svc, params)
        _token(body)
        return {"sleep_wanted": wanted}

    def apply(svc: Services, params: Params, body: Doc) -> Doc:
        b = _engine(svc, params)
        svc.capacity.accept(_token(body))
        was = b.rest
        svc.pool.set_sleep_wanted(b.id, wanted)
        log.info(
            "backend_sleep_wanted" if wanted else "backend_wake_wanted",
            backend=b.id,
            was=was.value,
            state=b.rest.value,
            why=_why(body),
            term=_token(body),  # the manager's fencing token (a "token" is redacted)
            by=params.get(CALLER) or None,
        )
        return engine_doc(b)

    def before(svc: Services, params: Params) -> Doc:
        b = svc.pool.get(params["backend_id"])
        return None if b is None else {"sleep_wanted": b.sleep_wanted}

    verb = "sleep" if wanted else "wake"
    return Action(
        "POST",
        f"/admin/backends/{{backend_id}}/{verb}",
        check,
        apply,
        before,
        json_body=True,
        skip_unchanged=True,
    )


def _rule_body(svc: Services, params: Params, body: Doc) -> dict[str, Any]:
    """The model's rule once ``body`` (some of its fields) is set over the current one."""
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object of the rule's fields.")
    unknown = sorted(set(body) - RULE_FIELDS)
    if unknown:
        raise InvalidRequest(
            f"Unknown capacity rule fields: {', '.join(unknown)}.", param=unknown[0]
        )
    try:
        given = RuleSettings.model_validate(body).given()
        current = svc.capacity.rules.get(params["model"])
        base = rule_doc(current) if current is not None else {}
        defaults = svc.config.current.capacity.defaults
        return rule_doc(rule_of(defaults, base, given))
    except (ValidationError, ValueError) as exc:
        raise InvalidRequest(f"Invalid capacity rule: {_first_error(exc)}") from None


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        e = exc.errors()[0]
        return f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
    return str(exc)


def _set_rule(svc: Services, params: Params, body: Doc) -> Doc:
    rule = _rule_body(svc, params, body)
    model = params["model"]
    svc.capacity.rules[model] = rule_of(rule)
    log.info("capacity_rule_set", model=model, rule=rule, by=params.get(CALLER) or None)
    return {"model": model, "rule": rule}


def _drop_rule_check(svc: Services, params: Params, _body: Doc) -> Doc:
    if params["model"] not in svc.capacity.rules:
        raise NotFound(f"No capacity rule for {params['model']!r}.")
    return None


def _drop_rule(svc: Services, params: Params, _body: Doc) -> Doc:
    """The model no longer managed: its engines wanted awake (the manager wakes them)."""
    model = params["model"]
    _drop_rule_check(svc, params, None)
    del svc.capacity.rules[model]
    pool = svc.pool
    woken = []
    for b in pool.serving(model):
        if b.sleep_wanted:
            pool.set_sleep_wanted(b.id, False)
            woken.append(b.id)
    log.info("capacity_rule_dropped", model=model, woken=woken, by=params.get(CALLER) or None)
    return {"model": model, "rule": None, "woken": woken}


def _rule_before(svc: Services, params: Params) -> Doc:
    rule = svc.capacity.rules.get(params["model"])
    return None if rule is None else rule_doc(rule)


_SLEEP: Final = _sleep(True)
_WAKE: Final = _sleep(False)
CAPACITY_ACTIONS: Final = (
    _SLEEP,
    _WAKE,
    Action(
        "PUT",
        "/admin/capacity/{model}",
        _rule_body,
        _set_rule,
        _rule_before,
        json_body=True,
        skip_unchanged=True,
    ),
    Action("DELETE", "/admin/capacity/{model}", _drop_rule_check, _drop_rule, _rule_before),
)


async def submit_sleep(
    svc: Services, backend: str, asleep: bool, why: str, token: int | None
) -> None:
    """The capacity manager's decision for ``backend`` (or a held request's wake) made for the
    fleet through its log (``submit_own``)."""
    action = _SLEEP if asleep else _WAKE
    body: dict[str, Any] = {"why": why}
    if token is not None:
        body["token"] = token
    caller = "capacity manager" if token is not None else "held request"
    await submit_own(svc, action, {"backend_id": backend}, body, caller)


def capacity_view(svc: Services) -> dict[str, Any]:
    """``GET /admin/capacity``: this replica's view."""
    book, pool = svc.capacity, svc.pool
    manager = svc.manager
    now = pool.now()
    engines = [
        # how long it has been in its state (None: not changed since this replica started)
        {**engine_doc(b), "state_for_s": round(now - b.rest_since, 1) if b.rest_since else None}
        for b in pool.all()
        if not b.removed
    ]
    counts = {r.value: sum(e["state"] == r.value for e in engines) for r in Rest}
    return {
        "enabled": book.enabled,
        "rules": {m: rule_doc(r) for m, r in book.rules.items()},
        "token": book.token,
        "engines": engines,
        "states": counts,
        "managing": manager is not None and manager.token is not None,
        "look": manager.look if manager is not None else {},
    }


async def get_capacity(request: web.Request) -> web.Response:
    return web.json_response(capacity_view(admin_of(request).svc))
