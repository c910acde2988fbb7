"""Every admin change the gateway can make at run time, as one table.

An action is checked, then applied. ``check`` validates a change against the running state
without changing anything and says what it would set (the audit trail's ``new``); ``apply``
makes it and answers the admin API's document. Both take the gateway app, the path's
parameters and the parsed body, so an action runs the same way whether the admin API called
it on a single gateway or a replica's follower took it from the fleet's change log
(``ActionApplier``). ``state``/``restore`` are what a snapshot of the change log holds: every
value these actions change.
"""

from __future__ import annotations

import json
import re
import secrets
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import structlog
from aiohttp import web

from backends.errors import GatewayError, InvalidRequest, NotFound
from gateway.admin.reload import (
    change_policy,
    describe_policy,
    plan_policy,
    read_settings,
    reload_settings,
)
from gateway.admin.views import backend_view
from gateway.fleet.changes import Change, Position, Snapshot
from gateway.fleet.follower import Outcome
from gateway.keys import LIMITER, POOL
from gateway.limits.keys import Authenticator, Budget, hash_key
from gateway.request.rollout import ROLLOUT

log = structlog.get_logger("gateway.admin.api")

KEY_PREFIX: Final = "sk-gw-"  # keys the gateway makes: recognisable in a leaked file

Params = Mapping[str, str]
Doc = Any  # a JSON document


@dataclass(frozen=True, slots=True)
class Action:
    method: str
    pattern: str  # aiohttp's form: /admin/backends/{backend_id}/drain
    check: Callable[[web.Application, Params, Doc], Doc]  # what it would set; raises if bad
    apply: Callable[[web.Application, Params, Doc], Doc]  # the answer's document
    before: Callable[[web.Application, Params], Doc]  # what it replaces (the audit's ``old``)
    json_body: bool = False
    # Run once, where the change is made, before anything else: the body to log and apply in
    # its place, and what to add to the answer there (a key made by the gateway: its secret
    # goes to the caller once, only its hash to the log)
    prepare: Callable[[web.Application, Params, Doc], tuple[Doc, dict[str, Any]]] | None = None

    def matcher(self) -> re.Pattern[str]:
        return re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", self.pattern) + "$")


def _backend(app: web.Application, params: Params) -> Any:
    b = app[POOL].get(params["backend_id"])
    if b is None:
        raise NotFound(f"No backend {params['backend_id']!r}.")
    return b


def _drain(draining: bool) -> Action:
    def check(app: web.Application, params: Params, _body: Doc) -> Doc:
        _backend(app, params)
        return {"draining": draining}

    def apply(app: web.Application, params: Params, _body: Doc) -> Doc:
        b = _backend(app, params)
        pool, was = app[POOL], b.draining
        pool.set_draining(b.id, draining)
        log.info("backend_drain_changed", backend=b.id, draining=draining, was=was)
        now = pool.now()
        return backend_view(b, now, pool.snapshot(b, now))

    def before(app: web.Application, params: Params) -> Doc:
        b = app[POOL].get(params["backend_id"])
        return None if b is None else {"draining": b.draining}

    verb = "drain" if draining else "undrain"
    return Action("POST", f"/admin/backends/{{backend_id}}/{verb}", check, apply, before)


def _check_policy(app: web.Application, _params: Params, body: Doc) -> Doc:
    plan_policy(app, body)
    return body


def _alias_weights_check(app: web.Application, params: Params, body: Doc) -> Doc:
    return app[ROLLOUT].checked_weights(params["alias"], body)


def _alias_weights(app: web.Application, params: Params) -> Doc:
    return app[ROLLOUT].aliases.get(params["alias"])


def _pool_drain(drained: bool) -> Action:
    def check(app: web.Application, params: Params, _body: Doc) -> Doc:
        app[ROLLOUT].check_drain(params["pool"], drained)
        return {"drained": drained}

    def apply(app: web.Application, params: Params, _body: Doc) -> Doc:
        return app[ROLLOUT].set_drained(params["pool"], drained)

    def before(app: web.Application, params: Params) -> Doc:
        return {"drained": params["pool"] in app[ROLLOUT].drained}

    verb = "drain" if drained else "undrain"
    return Action("POST", f"/admin/pools/{{pool}}/{verb}", check, apply, before)


def _reload_check(app: web.Application, _params: Params, _body: Doc) -> Doc:
    read_settings(app)
    return "reread the configuration file"


def _reload(app: web.Application, _params: Params, _body: Doc) -> Doc:
    result = reload_settings(app)
    return {"applied": result.applied, "restart_required": result.restart_required}


def _auth(app: web.Application) -> Authenticator:
    return app[LIMITER].auth


def _key_prepare(_app: web.Application, _params: Params, body: Doc) -> tuple[Doc, dict[str, Any]]:
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        raise InvalidRequest(
            'The body must be a JSON object: {"name": ..., "tier": ..., "hash": "sha256:..."}; '
            "without a hash the gateway makes the key and answers it once."
        )
    unknown = sorted(set(body) - {"name", "tier", "hash"})
    if unknown:
        raise InvalidRequest(f"Unknown field(s) for a key: {', '.join(unknown)}.")
    doc = {"name": body["name"], "tier": str(body.get("tier", "default"))}
    if "hash" in body:
        return {**doc, "hash": str(body["hash"])}, {}
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    extra = {"key": secret, "key_note": "shown once: the gateway keeps only its hash"}
    return {**doc, "hash": hash_key(secret)}, extra


def _key_check(app: web.Application, _params: Params, body: Doc) -> Doc:
    digest = _auth(app).check_add(body["name"], body["hash"], body["tier"])
    return {"name": body["name"], "tier": body["tier"], "hash": digest.hex()[:12]}


def _key_before(app: web.Application, params: Params) -> Doc:
    name = params.get("name")
    auth = _auth(app)
    return None if name is None or auth.tier_of(name) is None else auth.describe(name)


def _revoke_check(app: web.Application, params: Params, _body: Doc) -> Doc:
    if _auth(app).tier_of(params["name"]) is None:
        raise NotFound(f"No key {params['name']!r}.")
    return {"revoked": params["name"]}


def _budget_prepare(_app: web.Application, params: Params, body: Doc) -> tuple[Doc, dict[str, Any]]:
    """A budget's count gets its id where the change is made, so every replica (and a replay)
    counts under the same one."""
    if not isinstance(body, dict) or set(body) - {"tokens", "keep"}:
        raise InvalidRequest(
            'The body must be {"tokens": N} (null: no budget), with "keep": true to go on '
            "counting what the key has spent so far."
        )
    tokens = body.get("tokens")
    if tokens is not None and (
        not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1
    ):
        raise InvalidRequest("tokens: a positive whole number, or null for no budget.")
    counter = f"{params['name']}:{uuid.uuid4().hex}"
    return {"tokens": tokens, "keep": bool(body.get("keep", False)), "counter": counter}, {}


def _budget_of(app: web.Application, params: Params, body: Doc) -> Budget | None:
    if body.get("tokens") is None:
        return None
    current = _auth(app).budget(params["name"])
    keep = body.get("keep") and current is not None
    counter = current.counter if keep and current is not None else str(body["counter"])
    return Budget(int(body["tokens"]), counter)


def _budget_check(app: web.Application, params: Params, body: Doc) -> Doc:
    _auth(app).budget(params["name"])  # 404 if no such key
    return {"tokens": body.get("tokens"), "keep": body.get("keep")}


def _budget_apply(app: web.Application, params: Params, body: Doc) -> Doc:
    budget = _budget_of(app, params, body)
    doc = _auth(app).set_budget(params["name"], budget)
    return {**doc, "budget": None if budget is None else budget.tokens}


def _budget_before(app: web.Application, params: Params) -> Doc:
    auth = _auth(app)
    if auth.tier_of(params["name"]) is None:
        return None
    b = auth.budget(params["name"])
    return None if b is None else {"tokens": b.tokens}


ACTIONS: Final = (
    _drain(True),
    _drain(False),
    Action(
        "PUT",
        "/admin/policy",
        _check_policy,
        lambda app, _p, body: change_policy(app, body),
        lambda app, _p: describe_policy(app),
        json_body=True,
    ),
    Action(
        "PUT",
        "/admin/aliases/{alias}",
        _alias_weights_check,
        lambda app, p, body: app[ROLLOUT].set_weights(p["alias"], body),
        _alias_weights,
        json_body=True,
    ),
    Action(
        "POST",
        "/admin/aliases/{alias}/rollback",
        lambda app, p, _b: app[ROLLOUT].check_rollback(p["alias"]),
        lambda app, p, _b: app[ROLLOUT].rollback(p["alias"]),
        _alias_weights,
    ),
    _pool_drain(True),
    _pool_drain(False),
    Action("POST", "/admin/reload", _reload_check, _reload, lambda _app, _p: None),
    Action(
        "POST",
        "/admin/keys",
        _key_check,
        lambda app, _p, b: _auth(app).add(b["name"], b["hash"], b["tier"]),
        lambda _app, _p: None,
        json_body=True,
        prepare=_key_prepare,
    ),
    Action(
        "PUT",
        "/admin/keys/{name}/budget",
        _budget_check,
        _budget_apply,
        _budget_before,
        json_body=True,
        prepare=_budget_prepare,
    ),
    Action(
        "DELETE",
        "/admin/keys/{name}",
        _revoke_check,
        lambda app, p, _b: _auth(app).revoke(p["name"]),
        _key_before,
    ),
)
_MATCHERS: Final = [(a, a.matcher()) for a in ACTIONS]


def parse_body(action: Action, raw: bytes) -> Doc:
    if not action.json_body:
        return None
    try:
        return json.loads(raw or b"null")
    except ValueError as exc:
        raise InvalidRequest("The body must be JSON.") from exc


def find(method: str, path: str) -> tuple[Action, dict[str, str]] | None:
    """The action a request (or a change from the log) names, with its path's parameters."""
    path = path.partition("?")[0]
    for action, matcher in _MATCHERS:
        if action.method == method and (m := matcher.match(path)) is not None:
            return action, m.groupdict()
    return None


def run(app: web.Application, action: Action, params: Params, raw: bytes) -> Outcome:
    """Apply ``action``; its answer as a status and a JSON body, refusals in our error shape."""
    try:
        doc = action.apply(app, params, parse_body(action, raw))
    except GatewayError as err:
        return Outcome(err.status, json.dumps(err.envelope()).encode())
    return Outcome(200, json.dumps(doc).encode())


def state(app: web.Application) -> dict[str, Any]:
    """Every value the actions change, as this replica has it now (a snapshot's state)."""
    return {
        "draining": {b.id: b.draining for b in app[POOL].all()},
        "policy": describe_policy(app),
        "rollout": app[ROLLOUT].state(),
        "keys": _auth(app).state(),
    }


def restore(app: web.Application, doc: Mapping[str, Any]) -> None:
    """Take ``state()`` as another replica wrote it (backends this one lacks left out)."""
    pool = app[POOL]
    for backend_id, draining in dict(doc.get("draining", {})).items():
        if pool.get(backend_id) is not None:
            pool.set_draining(backend_id, bool(draining))
    policy = doc.get("policy")
    if isinstance(policy, dict):
        change_policy(app, {k: v for k, v in policy.items() if v is not None})
    app[ROLLOUT].restore(doc.get("rollout", {}))
    _auth(app).restore(doc.get("keys", {}))


class ActionApplier:
    """The fleet follower's ``Applier`` for a gateway app: changes from the log run as the
    admin API would run them here."""

    def __init__(self, app: web.Application) -> None:
        self.app = app

    async def apply(self, position: Position, change: Change) -> Outcome:
        found = find(change.method, change.path)
        if found is None:  # written by a newer version: said, and passed over
            return Outcome(404, f"no such change here: {change.method} {change.path}".encode())
        action, params = found
        return run(self.app, action, params, change.body)

    async def restore(self, snapshot: Snapshot) -> None:
        restore(self.app, snapshot.state)

    def export(self) -> dict[str, Any]:
        return state(self.app)
