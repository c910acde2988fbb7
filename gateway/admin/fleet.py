"""The admin API's side of the fleet: each change made once for every replica, with an id and
a known fate; the replicas and the audit trail, answered from the last state known when Redis
does not answer (``gateway.admin.lastknown``).

With a fleet (``gateway.fleet``: replicas sharing a Redis, or the workers of one host), a
change the admin API accepts is checked here against this replica's state, brought up to the
log's head first (a bad change is refused at once and changes nothing; one that would set what
is already set is answered ``"changed": false`` and not logged), appended to the fleet's log,
and applied by every replica's follower, this one's included. The answer is what applying it
answered here, with ``X-Gateway-Replicas: applied/alive`` (how many replicas had applied it
within ``fleet.wait``), ``X-Gateway-Change`` (its position in the log) and
``X-Gateway-Change-Id`` (its id: the caller's ``Idempotency-Key``, or one made here).

Every answer says only what is known (``gateway.fleet.member``): 503 only when the change
certainly did not reach the log; 202 with its id when it is in the log but not applied here
within the wait (``pending``), or when Redis took it and did not answer (``unknown``: it may be
in the log); ``GET /admin/changes/{id}`` tells what became of it, on any replica. A call
repeated with the same ``Idempotency-Key`` is answered with the first one's outcome
(``Idempotent-Replayed: true``) and never applied twice; one reusing a key for another request
is refused (422). Without a fleet (one process, ``fleet.log`` off), the change is applied here,
and repeats are recognised the same way (``Replays``).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Final

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from backends.errors import (
    FleetLogUnavailable,
    GatewayError,
    InvalidRequest,
    NotFound,
)
from gateway.admin.action import CALLER, Action
from gateway.admin.actions import find, parse_body
from gateway.admin.context import admin_of
from gateway.admin.lastknown import ViewUnavailable
from gateway.admin.replays import IDEMPOTENCY_HEADER
from gateway.fleet.changes import Change, Position, change_id, fingerprint
from gateway.fleet.fates import Fate
from gateway.fleet.member import Member, Submitted
from gateway.fleet.registry import Report, applied_by, summary

log = structlog.get_logger("gateway.admin.api")

CALLER_HEADER: Final = "X-Admin-Caller"  # who asks, for the audit trail (never a credential)
_CALLER: Final = re.compile(r"[^A-Za-z0-9_.@:/ -]")
_MAX_LISTED: Final = 500


def _caller(request: web.Request) -> str:
    named = _CALLER.sub("", request.headers.get(CALLER_HEADER, ""))[:64].strip()
    peer = request.remote or "local"
    return f"{named} ({peer})" if named else peer


def change_handler(action: Action) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        cid = change_id(request.headers.get(IDEMPOTENCY_HEADER))
        try:
            return await _change(request, action, cid)
        except GatewayError as err:  # refused, or certainly not written: its id said all the same
            err.headers["X-Gateway-Change-Id"] = cid
            raise

    return handler


async def _change(request: web.Request, action: Action, cid: str) -> web.Response:
    svc = admin_of(request).svc
    raw = await request.read()
    params = dict(request.match_info)
    if request.query.get("dry_run", "0") not in ("0", "false"):
        if action.dry_run is None:
            raise InvalidRequest("This change has no dry run; nothing was changed.")
        return web.json_response(action.dry_run(svc, params, parse_body(action, raw)))
    given = request.headers.get(IDEMPOTENCY_HEADER)
    fp = fingerprint(request.method, request.path_qs, raw)
    member = svc.fleet
    if member is None:
        return _alone(request, action, params, raw, cid=cid, fp=fp)
    done, current = await member.ready(cid, fp, repeat=given is not None)
    if done is not None:  # a repeat: the first call's change, never made twice
        return _answer(done, member, action, {})
    body, extra = parse_body(action, raw), dict[str, Any]()
    if action.prepare is not None:
        body, extra = action.prepare(svc, params, body)
    new = action.check(svc, params, body)  # refused: nothing logged
    old = action.before(svc, params)
    if action.skip_unchanged and old == new and current:  # "already so" of the latest state
        return _unchanged(cid, old)
    change = Change(
        method=request.method,
        path=request.path_qs,
        body=raw if action.prepare is None else json.dumps(body).encode(),
        content_type=request.content_type,
        replica=member.id,
        caller=_caller(request),
        at=time.time(),
        old=old,
        new=new,
        id=cid,
        fingerprint=fp,
    )
    return _answer(await member.submit(change), member, action, extra)


def _alone(
    request: web.Request, action: Action, params: dict[str, str], raw: bytes, *, cid: str, fp: str
) -> web.Response:
    """This replica alone: applied here at once (a refusal raises, as any admin error)."""
    admin = admin_of(request)
    svc, replays = admin.svc, admin.replays
    headers = {"X-Gateway-Change-Id": cid}
    kept = replays.get(cid, fp)
    if kept is not None:
        status, answer = kept
        headers["Idempotent-Replayed"] = "true"
        return web.Response(
            status=status, body=answer, content_type="application/json", headers=headers
        )
    body, extra = parse_body(action, raw), dict[str, Any]()
    if action.prepare is not None:
        body, extra = action.prepare(svc, params, body)
    if action.skip_unchanged and (old := action.before(svc, params)) == action.check(
        svc, params, body
    ):
        return _unchanged(cid, old)
    doc = action.apply(svc, {**params, CALLER: _caller(request)}, body)
    replays.put(cid, fp, 200, json.dumps(doc).encode())  # the secret made here: never kept
    return web.json_response({**doc, **extra}, headers=headers)


def _unchanged(cid: str, current: Any) -> web.Response:
    return web.json_response(
        {
            "changed": False,
            "state": current,
            "message": "Already so: nothing was changed, and nothing was logged.",
        },
        headers={"X-Gateway-Change-Id": cid, "X-Gateway-Change": "none"},
    )


def _answer(done: Submitted, member: Member, action: Action, extra: dict[str, Any]) -> web.Response:
    """The answer to a change: its outcome here, or what is known of it (202)."""
    headers = {"X-Gateway-Change-Id": done.id, "X-Gateway-Replicas": done.spread.header()}
    headers["X-Gateway-Change"] = "unknown" if done.position is None else str(done.position)
    if done.replayed:
        headers["Idempotent-Replayed"] = "true"
        extra = {}  # what the first call made once (a key's secret) went to that call only
    if done.position is None:
        doc = {
            "id": done.id,
            "state": "unknown",
            "applied_here": False,
            "message": "Redis took the change and did not answer within "
            f"{member.settings.log_timeout:g} s: it may be in the fleet's log. "
            f"GET /admin/changes/{done.id} tells once Redis answers; a call repeated with the "
            "same Idempotency-Key never applies it twice.",
            **extra,
        }
        return web.json_response(doc, status=202, headers=headers)
    if done.outcome is None:
        doc = {
            "id": done.id,
            "position": str(done.position),
            "state": "pending",
            "applied_here": False,
            "message": "The change is in the fleet's log; this replica has not "
            f"applied it within {member.settings.wait:g} s.",
            **extra,
        }
        return web.json_response(doc, status=202, headers=headers)
    answer = done.outcome.body
    if done.outcome.applied and (extra or done.replayed):
        doc = json.loads(answer)
        if done.replayed and action.prepare is not None:
            extra = {
                "replayed_note": "an earlier call with this Idempotency-Key made this change; "
                "anything it made once (a key's secret) was in that call's answer only"
            }
        answer = json.dumps({**doc, **extra}).encode()
    return web.Response(
        status=done.outcome.status,
        body=answer,
        content_type="application/json",
        headers=headers,
    )


async def change_fate(request: web.Request) -> web.Response:
    """``GET /admin/changes/{id}``: what became of a change, as this replica knows it
    (``gateway.fleet.member.Fate``), and how many replicas applied it."""
    cid = change_id(request.match_info["id"])
    member = _member(request)
    if member is None:
        kept = admin_of(request).replays.get(cid, None)
        if kept is None:
            raise NotFound(f"No change {cid!r} was made here (in the last day).")
        return web.json_response(
            {"id": cid, "state": "applied", "applied_here": True, "outcome": _outcome(*kept)}
        )
    fate = await member.fates.fate(cid)
    doc: dict[str, Any] = {
        "id": cid,
        "state": fate.state,
        "position": None if fate.position is None else str(fate.position),
        "applied_here": fate.state in ("applied", "refused"),
        "epoch": member.follower.epoch,
    }
    if fate.outcome is not None:
        doc["outcome"] = _outcome(fate.outcome.status, fate.outcome.body)
    doc["replicas"] = await _reached(request, member, fate)
    return web.json_response(doc)


def _outcome(status: int, body: bytes) -> dict[str, Any]:
    try:
        parsed: Any = json.loads(body)
    except ValueError:
        parsed = body.decode(errors="replace")
    return {"status": status, "body": parsed}


async def _reached(request: web.Request, member: Member, fate: Fate) -> dict[str, Any] | None:
    """How many replicas report the change applied (None: not in the log, or no registry)."""
    if fate.position is None:
        return None
    doc = await _replicas_doc(request, member)
    views = doc["replicas"]
    standings = ((v["applied"], v["epoch"]) for v in views)
    done = applied_by(standings, fate.position, member.follower.epoch)
    return {"applied": done, "alive": len(views), "stale": "stale" in doc}


async def record_done(request: web.Request, path: str, body: dict[str, Any]) -> dict[str, str]:
    """A change this replica made once for the fleet (on the backends: a LoRA adapter loaded)
    recorded in the fleet's log, so every replica applies its effect at once, in the log's
    order; the headers for the answer. Without a fleet, applied here. Redis out of reach: the
    backends already changed, so it is applied here, said in the log and in the answer, and the
    other replicas learn it from the backends' ``/v1/models`` at their next poll."""
    svc = admin_of(request).svc
    found = find("POST", path)
    assert found is not None, path
    action, params = found
    member = svc.fleet
    if member is None:
        action.apply(svc, params, body)
        return {}
    raw = json.dumps(body).encode()
    change = Change(
        method="POST",
        path=path,
        body=raw,
        replica=member.id,
        caller=_caller(request),
        at=time.time(),
        old=action.before(svc, params),
        new=action.check(svc, params, body),
        id=change_id(None),
        fingerprint=fingerprint("POST", path, raw),
    )
    try:
        done = await member.submit(change)
    except FleetLogUnavailable as exc:
        action.apply(svc, params, body)
        log.warning("fleet_record_failed", path=path, error=exc.message)
        return {"X-Gateway-Replicas": "unrecorded"}
    if done.position is None:  # perhaps in the log: applied here all the same (idempotent)
        action.apply(svc, params, body)
        return {"X-Gateway-Replicas": "unknown", "X-Gateway-Change-Id": done.id}
    return {
        "X-Gateway-Replicas": done.spread.header(),
        "X-Gateway-Change": str(done.position),
        "X-Gateway-Change-Id": done.id,
    }


def _member(request: web.Request) -> Member | None:
    return admin_of(request).svc.fleet


async def _replicas_doc(request: web.Request, member: Member) -> dict[str, Any]:
    """The replicas as the registry has them (or as last known, with this replica's own
    report as it is now)."""

    async def fetch() -> dict[str, Any]:
        reports = await member.registry.replicas()
        head = await member.changes.head()
        return _replicas_view(member, reports, head)

    def fallback() -> dict[str, Any]:
        return _replicas_view(member, [], None)

    doc = await admin_of(request).views.read("replicas", fetch, fallback)
    if "stale" in doc:  # the others as last known, this replica as it is now, summed again
        reports = [Report.decode(json.dumps(r)) for r in doc["_reports"]]
        head = None if doc["summary"]["head"] is None else Position.parse(doc["summary"]["head"])
        doc = {**_replicas_view(member, reports, head), "stale": doc["stale"]}
    return {k: v for k, v in doc.items() if k != "_reports"}


def _replicas_view(member: Member, reports: list[Report], head: Any) -> dict[str, Any]:
    now = time.time()
    reports = sorted(
        [*(r for r in reports if r.id != member.id), member.report()], key=lambda r: r.id
    )
    return {
        "_reports": [json.loads(r.encode()) for r in reports if r.id != member.id],
        "fleet": member.settings.fleet,
        "self": member.id,
        "log_reachable": member.follower.reachable,
        "log": member.log_state(),
        "losses": member.losses,
        "summary": dict(summary(reports, head, member.follower.epoch)),
        "replicas": [r.view(now) for r in reports],
    }


async def list_replicas(request: web.Request) -> web.Response:
    """``GET /admin/replicas``: every replica of the fleet as it last reported itself (its
    figures since it started included), and what they say together (who lags behind the log,
    whose log is lost or another, whose health views disagree, the fleet's figures: the
    replicas' summed). From the last state known, marked stale, while Redis does not answer."""
    member = _member(request)
    if member is None:
        return web.json_response({"fleet": None, "replicas": []})
    return web.json_response(await _replicas_doc(request, member))


async def list_changes(request: web.Request) -> web.Response:
    """``GET /admin/changes?limit=N``: the audit trail, newest first (what changed, old and
    new, when, through which replica and by whom). From the last state known, marked stale,
    while Redis does not answer."""
    member = _member(request)
    try:
        limit = min(_MAX_LISTED, max(1, int(request.query.get("limit", "50"))))
    except ValueError:
        limit = 50
    if member is None:
        return web.json_response({"fleet": None, "changes": []})

    async def fetch() -> dict[str, Any]:
        recent = await member.changes.recent(limit)
        return {"changes": [change.describe(position) for position, change in recent]}

    # One listing kept (the last read): a stale answer is as much of it as asked for
    doc = await admin_of(request).views.read("changes", fetch, lambda: {"changes": []})
    doc = {**doc, "changes": doc["changes"][:limit]}
    applied = member.follower.applied
    return web.json_response(
        {
            "fleet": member.settings.fleet,
            "applied": None if applied is None else str(applied),
            "epoch": member.follower.epoch,
            **doc,
        }
    )


async def reload_through_log(member: Member) -> None:
    """SIGHUP in a fleet: a reload made as an admin change (every replica re-reads its file)."""
    change = Change(
        "POST",
        "/admin/reload",
        replica=member.id,
        caller="SIGHUP",
        at=time.time(),
        id=change_id(None),
        fingerprint=fingerprint("POST", "/admin/reload", b""),
    )
    try:
        done = await member.submit(change)
    except FleetLogUnavailable as exc:
        log.warning("reload_refused", error=exc.message)
        return
    position = "unknown" if done.position is None else str(done.position)
    log.info("reload_logged", id=done.id, position=position, replicas=done.spread.header())


async def list_keys(request: web.Request) -> web.Response:
    """``GET /admin/keys``: the API keys in force (name, tier, where from, a hash prefix,
    labels, expiry, its budget with what it spent this day and month). The spent counts from
    the last state known, marked stale, while their store does not answer."""
    limiter = admin_of(request).svc.limiter

    async def fetch() -> dict[str, Any]:
        keys = []
        for doc in limiter.auth.listing():
            budget = await limiter.budget_view(doc["name"], limiter.auth.budget(doc["name"]))
            if budget is not None and any(p["spent"] is None for p in budget["periods"].values()):
                raise ViewUnavailable("the budgets' counts cannot be read")
            keys.append({**doc, "budget": budget})
        return {"keys": keys}

    def fallback() -> dict[str, Any]:
        return {"keys": [{**doc, "budget": None} for doc in limiter.auth.listing()]}

    doc = await admin_of(request).views.read("keys", fetch, fallback)
    if "stale" in doc:  # the keys themselves are this replica's, never stale
        spent = {k["name"]: k.get("budget") for k in doc["keys"]}
        doc = {
            **doc,
            "keys": [{**k, "budget": spent.get(k["name"])} for k in fallback()["keys"]],
        }
    return web.json_response(doc)


_USAGE_DAYS: Final = 31
_MAX_USAGE_DAYS: Final = 93


async def key_usage(request: web.Request) -> web.Response:
    """``GET /admin/keys/{name}/usage?days=N``: the key's budget and what it spent in each
    period, and its tokens by day (the last N, default 31) and model; from the last state
    known, marked stale, while their store does not answer."""
    try:
        days = int(request.query.get("days", _USAGE_DAYS))
    except ValueError:
        raise InvalidRequest("days: a whole number of days.") from None
    if not 1 <= days <= _MAX_USAGE_DAYS:
        raise InvalidRequest(f"days: 1 to {_MAX_USAGE_DAYS}.")
    limiter, name = admin_of(request).svc.limiter, request.match_info["name"]
    limiter.auth.budget(name)  # NotFound if no such key, before anything is read

    async def fetch() -> dict[str, Any]:
        doc = await limiter.usage(name, days)
        budget = doc.get("budget")
        spent_unknown = budget is not None and any(
            p["spent"] is None for p in budget["periods"].values()
        )
        if doc.get("days") is None or spent_unknown:
            raise ViewUnavailable("the usage counts cannot be read")
        return doc

    def fallback() -> dict[str, Any]:
        return {"name": name, "budget": None, "days": None}

    return web.json_response(
        await admin_of(request).views.read(f"usage:{name}:{days}", fetch, fallback)
    )


def add_fleet_routes(app: web.Application) -> None:
    """The fleet's views and the fates of changes on the admin app."""
    app.router.add_get("/admin/replicas", list_replicas)
    app.router.add_get("/admin/changes", list_changes)
    app.router.add_get("/admin/changes/{id}", change_fate)
    app.router.add_get("/admin/keys", list_keys)
    app.router.add_get("/admin/keys/{name}/usage", key_usage)
