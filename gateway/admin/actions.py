"""Every admin change the gateway can make at run time, as one table.

An action is checked, then applied. ``check`` validates a change against the running state
without changing anything and says what it would set (the audit trail's ``new``); ``apply``
makes it and answers the admin API's document. Both take the gateway's services, the path's
parameters and the parsed body, so an action runs the same way whether the admin API called
it on a single gateway or a replica's follower took it from the fleet's change log
(``ActionApplier``). ``state``/``restore`` are what a snapshot of the change log holds: every
value these actions change.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final

import structlog

from backends.errors import GatewayError, InvalidRequest, NotFound
from gateway.admin import capacity, rollouts
from gateway.admin.action import CALLER, Action, Doc, Params
from gateway.admin.reload import (
    change_policy,
    describe_policy,
    plan_policy,
    read_settings,
    reload_settings,
)
from gateway.admin.state import reload_plan
from gateway.admin.views import backend_view
from gateway.fleet.changes import Change, Position, Snapshot
from gateway.fleet.follower import ChangeOutcome
from gateway.limits.budget import FIELDS, Budget, iso
from gateway.limits.keys import Authenticator, check_labels, check_limits, hash_key
from gateway.request.services import Services

log = structlog.get_logger("gateway.admin.api")

KEY_PREFIX: Final = "sk-gw-"  # keys the gateway makes: recognisable in a leaked file


def _backend(svc: Services, params: Params) -> Any:
    b = svc.pool.get(params["backend_id"])
    if b is None:
        raise NotFound(f"No backend {params['backend_id']!r}.")
    return b


def _drain(draining: bool) -> Action:
    def check(svc: Services, params: Params, _body: Doc) -> Doc:
        _backend(svc, params)
        return {"draining": draining}

    def apply(svc: Services, params: Params, _body: Doc) -> Doc:
        b = _backend(svc, params)
        pool, was = svc.pool, b.draining
        pool.set_draining(b.id, draining)
        log.info("backend_drain_changed", backend=b.id, draining=draining, was=was)
        now = pool.now()
        return backend_view(b, now, pool.snapshot(b, now))

    def before(svc: Services, params: Params) -> Doc:
        b = svc.pool.get(params["backend_id"])
        return None if b is None else {"draining": b.draining}

    verb = "drain" if draining else "undrain"
    return Action(
        "POST", f"/admin/backends/{{backend_id}}/{verb}", check, apply, before, skip_unchanged=True
    )


def _check_policy(svc: Services, _params: Params, body: Doc) -> Doc:
    plan_policy(svc, body)
    return body


def _alias_weights_check(svc: Services, params: Params, body: Doc) -> Doc:
    return svc.rollout.checked_weights(params["alias"], body)


def _alias_weights(svc: Services, params: Params) -> Doc:
    return svc.rollout.aliases.get(params["alias"])


def _rollback_check(svc: Services, params: Params, _body: Doc) -> Doc:
    rollouts.not_under_way(svc, params["alias"])
    return svc.rollout.check_rollback(params["alias"])


def _rollback(svc: Services, params: Params, _body: Doc) -> Doc:
    """Back to the weights before the last change (a progressive rollout's: before it began);
    refused while one is under way."""
    rollouts.not_under_way(svc, params["alias"])
    return svc.rollout.rollback(params["alias"])


def _pool_drain(drained: bool) -> Action:
    def check(svc: Services, params: Params, _body: Doc) -> Doc:
        svc.rollout.check_drain(params["pool"], drained)
        return {"drained": drained}

    def apply(svc: Services, params: Params, _body: Doc) -> Doc:
        return svc.rollout.set_drained(params["pool"], drained)

    def before(svc: Services, params: Params) -> Doc:
        return {"drained": params["pool"] in svc.rollout.drained}

    verb = "drain" if drained else "undrain"
    return Action(
        "POST", f"/admin/pools/{{pool}}/{verb}", check, apply, before, skip_unchanged=True
    )


def _reload_check(svc: Services, _params: Params, _body: Doc) -> Doc:
    read_settings(svc)
    return "reread the configuration file"


def _reload(svc: Services, _params: Params, _body: Doc) -> Doc:
    result = reload_settings(svc)
    return {"applied": result.applied, "restart_required": result.restart_required}


def _auth(svc: Services) -> Authenticator:
    return svc.limiter.auth


def _new_secret() -> tuple[str, dict[str, Any]]:
    """A key made here: its hash for the log, the key itself for the caller, once."""
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    return hash_key(secret), {
        "key": secret,
        "key_note": "shown once: the gateway keeps only its hash",
    }


def _expires_at(value: Any) -> float | None:
    """``expires_at`` as sent (ISO 8601, or Unix seconds) as Unix time, in the future."""
    if value is None:
        return None
    try:
        if isinstance(value, int | float) and not isinstance(value, bool):
            at = float(value)
        else:
            parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=UTC)
            at = parsed.timestamp()
    except ValueError:
        raise InvalidRequest(
            "expires_at: an ISO 8601 time (UTC if no zone) or Unix seconds."
        ) from None
    if at <= time.time():
        raise InvalidRequest("expires_at is in the past.")
    return at


_KEY_FIELDS: Final = {"name", "tier", "hash", "labels", "limits", "expires_at", *FIELDS.values()}


def _key_prepare(_svc: Services, _params: Params, body: Doc) -> tuple[Doc, dict[str, Any]]:
    """Checked and made whole where the change is made: the expiry as Unix time, and without
    a hash, a key made here (its secret answered once, its hash logged)."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        raise InvalidRequest(
            'The body must be a JSON object: {"name": ..., "tier": ..., "hash": "sha256:...", '
            '"labels": {...}, "limits": {"requests_per_minute": N, ...}, '
            '"expires_at": "2027-01-01T00:00:00Z", "tokens_per_day": N, '
            '"tokens_per_month": N}; without a hash the gateway makes the key and answers it once.'
        )
    unknown = sorted(set(body) - _KEY_FIELDS)
    if unknown:
        raise InvalidRequest(f"Unknown field(s) for a key: {', '.join(unknown)}.")
    budget = Budget.from_json({k: body.get(k) for k in FIELDS.values()})
    doc = {
        "name": body["name"],
        "tier": str(body.get("tier", "default")),
        "labels": check_labels(body.get("labels") or {}),
        "limits": check_limits(body.get("limits") or {}),
        "expires_at": _expires_at(body.get("expires_at")),
        "budget": None if budget is None else budget.to_json(),
    }
    if "hash" in body:
        return {**doc, "hash": str(body["hash"])}, {}
    digest, extra = _new_secret()
    return {**doc, "hash": digest}, extra


def _key_check(svc: Services, _params: Params, body: Doc) -> Doc:
    digest = _auth(svc).check_add(body["name"], body["hash"], body["tier"])
    return {
        "name": body["name"],
        "tier": body["tier"],
        "hash": digest.hex()[:12],
        "labels": body.get("labels"),
        "limits": body.get("limits"),
        "expires_at": body.get("expires_at"),
        "budget": body.get("budget"),
    }


def _key_apply(svc: Services, _params: Params, body: Doc) -> Doc:
    budget = body.get("budget")
    return _auth(svc).add(
        body["name"],
        body["hash"],
        body["tier"],
        labels=body.get("labels") or {},
        expires_at=body.get("expires_at"),
        budget=None if not budget else Budget.from_json(budget),
        limits=check_limits(body.get("limits") or {}),
    )


def _key_before(svc: Services, params: Params) -> Doc:
    name = params.get("name")
    auth = _auth(svc)
    return None if name is None or auth.tier_of(name) is None else auth.describe(name)


_MAX_OVERLAP_S: Final = 30 * 86_400


def _rotate_prepare(_svc: Services, _params: Params, body: Doc) -> tuple[Doc, dict[str, Any]]:
    """The old secret's last moment, decided here (every replica honours it until then)."""
    body = {} if body is None else body
    if not isinstance(body, dict) or set(body) - {"overlap_seconds", "hash"}:
        raise InvalidRequest(
            'The body, if any: {"overlap_seconds": N} (how long the old key still works, '
            f'at most {_MAX_OVERLAP_S}; default 3600), and "hash" to give the new key\'s hash.'
        )
    overlap = body.get("overlap_seconds", 3600)
    if (
        not isinstance(overlap, int | float)
        or isinstance(overlap, bool)
        or not 0 <= overlap <= _MAX_OVERLAP_S
    ):
        raise InvalidRequest(f"overlap_seconds: 0 to {_MAX_OVERLAP_S}.")
    doc = {"previous_until": time.time() + float(overlap)}
    if "hash" in body:
        return {**doc, "hash": str(body["hash"])}, {}
    digest, extra = _new_secret()
    return {**doc, "hash": digest}, extra


def _rotate_check(svc: Services, params: Params, body: Doc) -> Doc:
    digest = _auth(svc).check_rotate(params["name"], body["hash"])
    return {"hash": digest.hex()[:12], "previous_until": iso(float(body["previous_until"]))}


def _revoke_check(svc: Services, params: Params, _body: Doc) -> Doc:
    if _auth(svc).tier_of(params["name"]) is None:
        raise NotFound(f"No key {params['name']!r}.")
    return {"revoked": params["name"]}


def _budget_body(body: Doc) -> Budget | None:
    if not isinstance(body, dict):
        raise InvalidRequest(
            'The body must be {"tokens_per_day": N, "tokens_per_month": N} (null: none for '
            "that period; both null: the key's tier's budget, if any)."
        )
    return Budget.from_json(body)


def _budget_check(svc: Services, params: Params, body: Doc) -> Doc:
    budget = _budget_body(body)
    _auth(svc).budget(params["name"])  # 404 if no such key
    return None if budget is None else budget.to_json()


def _budget_apply(svc: Services, params: Params, body: Doc) -> Doc:
    budget = _budget_body(body)
    doc = _auth(svc).set_budget(params["name"], budget)
    current = _auth(svc).budget(params["name"])
    return {
        **doc,
        "budget": None if current is None else {"source": current.source, **current.to_json()},
    }


def _budget_before(svc: Services, params: Params) -> Doc:
    auth = _auth(svc)
    if auth.tier_of(params["name"]) is None:
        return None
    b = auth.budget(params["name"])
    return None if b is None else {"source": b.source, **b.to_json()}


ADAPTERS_PATH: Final = "/admin/lora/applied"


def _adapters_check(_svc: Services, _params: Params, body: Doc) -> Doc:
    ok = (
        isinstance(body, dict)
        and body.get("op") in ("load", "unload")
        and isinstance(body.get("lora_name"), str)
        and isinstance(body.get("backends"), list)
    )
    if not ok:
        raise InvalidRequest('{"op": "load"|"unload", "lora_name": ..., "backends": [...]}')
    return body


def _adapters_apply(svc: Services, params: Params, body: Doc) -> Doc:
    """A LoRA adapter loaded on (or taken off) backends, once, by the replica that was asked:
    here, the backends' models say so at once (not at the next poll of ``/v1/models``), and
    the fleet's record of adapters (a snapshot's) follows."""
    _adapters_check(svc, params, body)
    pool, name = svc.pool, str(body["lora_name"])
    held = svc.adapters.get(name)
    backends = set(map(str, held["backends"])) if held else set()  # type: ignore[call-overload]
    for backend_id in map(str, body["backends"]):
        b = pool.get(backend_id)
        if body["op"] == "load":
            backends.add(backend_id)
            if b is not None:
                pool.record_models(backend_id, b.models | {name})
        else:
            backends.discard(backend_id)
            if b is not None:
                pool.record_models(backend_id, b.models - {name})
    if backends:
        svc.adapters[name] = {
            "lora_path": body.get("lora_path", held.get("lora_path") if held else None),
            "model": body.get("model", held.get("model") if held else None),
            "backends": sorted(backends),
        }
    else:
        svc.adapters.pop(name, None)
    return {"lora_name": name, "adapter": svc.adapters.get(name)}


ACTIONS: Final = (
    _drain(True),
    _drain(False),
    Action(
        "PUT",
        "/admin/policy",
        _check_policy,
        lambda svc, _p, body: change_policy(svc, body),
        lambda svc, _p: describe_policy(svc),
        json_body=True,
    ),
    Action(
        "PUT",
        "/admin/aliases/{alias}",
        _alias_weights_check,
        lambda svc, p, body: svc.rollout.set_weights(p["alias"], body),
        _alias_weights,
        json_body=True,
    ),
    Action(
        "POST",
        "/admin/aliases/{alias}/rollback",
        _rollback_check,
        _rollback,
        _alias_weights,
    ),
    _pool_drain(True),
    _pool_drain(False),
    Action(
        "POST",
        "/admin/reload",
        _reload_check,
        _reload,
        lambda _svc, _p: None,
        dry_run=lambda svc, _p, _b: reload_plan(svc),
    ),
    Action(
        "POST",
        "/admin/keys",
        _key_check,
        _key_apply,
        lambda _svc, _p: None,
        json_body=True,
        prepare=_key_prepare,
    ),
    Action(
        "POST",
        "/admin/keys/{name}/rotate",
        _rotate_check,
        lambda svc, p, b: _auth(svc).rotate(p["name"], b["hash"], float(b["previous_until"])),
        _key_before,
        json_body=True,
        prepare=_rotate_prepare,
    ),
    Action(
        "PUT",
        "/admin/keys/{name}/budget",
        _budget_check,
        _budget_apply,
        _budget_before,
        json_body=True,
    ),
    Action(
        "POST",
        ADAPTERS_PATH,
        _adapters_check,
        _adapters_apply,
        lambda svc, _p: None,
        json_body=True,
        routed=False,
    ),
    Action(
        "DELETE",
        "/admin/keys/{name}",
        _revoke_check,
        lambda svc, p, _b: _auth(svc).revoke(p["name"]),
        _key_before,
    ),
    *rollouts.ROLLOUT_ACTIONS,
    *capacity.CAPACITY_ACTIONS,
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


def run(svc: Services, action: Action, params: Params, raw: bytes) -> ChangeOutcome:
    """Apply ``action``; its answer as a status and a JSON body, refusals in our error shape."""
    try:
        doc = action.apply(svc, params, parse_body(action, raw))
    except GatewayError as err:
        return ChangeOutcome(err.status, json.dumps(err.envelope()).encode())
    return ChangeOutcome(200, json.dumps(doc).encode())


def state(svc: Services) -> dict[str, Any]:
    """Every value the actions change, as this replica has it now (a snapshot's state)."""
    return {
        "draining": {b.id: b.draining for b in svc.pool.all()},
        "policy": describe_policy(svc),
        "rollout": svc.rollout.state(),
        "keys": _auth(svc).state(),
        "adapters": {name: dict(held) for name, held in svc.adapters.items()},
        **rollouts.state(svc),
        "capacity": {
            **svc.capacity.state(),
            "sleep_wanted": sorted(b.id for b in svc.pool.all() if b.sleep_wanted),
        },
    }


def restore(svc: Services, doc: Mapping[str, Any]) -> None:
    """Take ``state()`` as another replica wrote it (backends this one lacks left out)."""
    pool = svc.pool
    for backend_id, draining in dict(doc.get("draining", {})).items():
        if pool.get(backend_id) is not None:
            pool.set_draining(backend_id, bool(draining))
    policy = doc.get("policy")
    if isinstance(policy, dict):
        change_policy(svc, {k: v for k, v in policy.items() if v is not None})
    svc.rollout.restore(doc.get("rollout", {}))
    _auth(svc).restore(doc.get("keys", {}))
    # The record only: the backends' models come from their own /v1/models, as at start.
    adapters = doc.get("adapters", {})
    held: dict[str, dict[str, object]] = {}
    if isinstance(adapters, dict):
        held = {str(k): dict(v) for k, v in adapters.items() if isinstance(v, dict)}
    svc.adapters.clear()
    svc.adapters.update(held)
    rollouts.restore(svc, doc)
    held_capacity = doc.get("capacity")
    if isinstance(held_capacity, dict):
        svc.capacity.restore(held_capacity)
        asleep = set(held_capacity.get("sleep_wanted") or ())
        for b in pool.all():
            if b.sleep_wanted != (b.id in asleep):
                pool.set_sleep_wanted(b.id, b.id in asleep)


class ActionApplier:
    """The fleet follower's ``Applier`` for the gateway's services (``services``: they hold the
    fleet's member, which holds this, so they are asked for once the follower runs): changes
    from the log run as the admin API would run them here."""

    def __init__(self, services: Callable[[], Services]) -> None:
        self._services = services

    async def apply(self, position: Position, change: Change) -> ChangeOutcome:
        found = find(change.method, change.path)
        if found is None:  # written by a newer version: said, and passed over
            return ChangeOutcome(
                404, f"no such change here: {change.method} {change.path}".encode()
            )
        action, params = found
        return run(self._services(), action, {**params, CALLER: change.caller}, change.body)

    async def restore(self, snapshot: Snapshot) -> None:
        restore(self._services(), snapshot.state)

    def export(self) -> dict[str, Any]:
        return state(self._services())
