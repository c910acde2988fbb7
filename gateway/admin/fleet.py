"""The admin API's side of the fleet: each change made once for every replica, the replicas,
the audit trail.

With a fleet (``gateway.fleet``: replicas sharing a Redis, or the workers of one host), a
change the admin API accepts is checked here against this replica's state (a bad one is
refused at once and changes nothing), appended to the fleet's log, and applied by every
replica's follower, this one's included; the answer is what applying it answered here, with
``X-Gateway-Replicas: applied/alive`` (how many replicas had applied it within ``fleet.wait``)
and ``X-Gateway-Change`` (its position in the log). A change not applied here within the wait
is answered 202 with its position: it is in the log and will be applied.
Without a fleet (one process, ``fleet.log`` off), the change is applied here.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Final

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from backends.errors import FleetLogUnavailable, InvalidRequest
from gateway.admin.action import CALLER, Action
from gateway.admin.actions import find, parse_body
from gateway.fleet.changes import Change
from gateway.fleet.member import Member
from gateway.fleet.registry import summary
from gateway.keys import FLEET, GATEWAY, LIMITER

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
        gateway = request.app[GATEWAY]
        raw = await request.read()
        params = dict(request.match_info)
        body, extra = parse_body(action, raw), dict[str, Any]()
        if action.prepare is not None:
            body, extra = action.prepare(gateway, params, body)
            raw = json.dumps(body).encode()
        member, caller = gateway[FLEET], _caller(request)
        if member is None:  # this replica alone: a refusal raises, as any admin error
            done = action.apply(gateway, {**params, CALLER: caller}, body)
            return web.json_response({**done, **extra})
        new = action.check(gateway, params, body)  # refused: nothing logged
        change = Change(
            method=request.method,
            path=request.path_qs,
            body=raw,
            content_type=request.content_type,
            replica=member.id,
            caller=caller,
            at=time.time(),
            old=action.before(gateway, params),
            new=new,
        )
        done = await member.submit(change)
        headers = {
            "X-Gateway-Replicas": done.spread.header(),
            "X-Gateway-Change": str(done.position),
        }
        if done.outcome is None:
            return web.json_response(
                {
                    "position": str(done.position),
                    "applied_here": False,
                    "message": "The change is in the fleet's log; this replica has not "
                    f"applied it within {member.settings.wait:g} s.",
                },
                status=202,
                headers=headers,
            )
        answer = done.outcome.body
        if extra and done.outcome.applied:
            answer = json.dumps({**json.loads(answer), **extra}).encode()
        return web.Response(
            status=done.outcome.status,
            body=answer,
            content_type="application/json",
            headers=headers,
        )

    return handler


async def record_done(request: web.Request, path: str, body: dict[str, Any]) -> dict[str, str]:
    """A change this replica made once for the fleet (on the backends: a LoRA adapter loaded)
    recorded in the fleet's log, so every replica applies its effect at once, in the log's
    order; the headers for the answer. Without a fleet, applied here. Redis out of reach: the
    backends already changed, so it is applied here, said in the log and in the answer, and the
    other replicas learn it from the backends' ``/v1/models`` at their next poll."""
    gateway = request.app[GATEWAY]
    found = find("POST", path)
    assert found is not None, path
    action, params = found
    member = gateway[FLEET]
    if member is None:
        action.apply(gateway, params, body)
        return {}
    change = Change(
        method="POST",
        path=path,
        body=json.dumps(body).encode(),
        replica=member.id,
        caller=_caller(request),
        at=time.time(),
        old=action.before(gateway, params),
        new=action.check(gateway, params, body),
    )
    try:
        done = await member.submit(change)
    except FleetLogUnavailable as exc:
        action.apply(gateway, params, body)
        log.warning("fleet_record_failed", path=path, error=exc.message)
        return {"X-Gateway-Replicas": "unrecorded"}
    return {"X-Gateway-Replicas": done.spread.header(), "X-Gateway-Change": str(done.position)}


def _member(request: web.Request) -> Member | None:
    return request.app[GATEWAY][FLEET]


async def list_replicas(request: web.Request) -> web.Response:
    """``GET /admin/replicas``: every replica of the fleet as it last reported itself (its
    figures since it started included), and what they say together (who lags behind the log,
    whose health views disagree, the fleet's figures: the replicas' summed)."""
    member = _member(request)
    if member is None:
        return web.json_response({"fleet": None, "replicas": []})
    reports = await member.registry.replicas()
    head = await member.changes.head()
    now = time.time()
    return web.json_response(
        {
            "fleet": member.settings.fleet,
            "self": member.id,
            "log_reachable": member.follower.reachable,
            "summary": dict(summary(reports, head)),
            "replicas": [r.view(now) for r in reports],
        }
    )


async def list_changes(request: web.Request) -> web.Response:
    """``GET /admin/changes?limit=N``: the audit trail, newest first (what changed, old and
    new, when, through which replica and by whom)."""
    member = _member(request)
    try:
        limit = min(_MAX_LISTED, max(1, int(request.query.get("limit", "50"))))
    except ValueError:
        limit = 50
    if member is None:
        return web.json_response({"fleet": None, "changes": []})
    recent = await member.changes.recent(limit)
    return web.json_response(
        {
            "fleet": member.settings.fleet,
            "applied": None if member.follower.applied is None else str(member.follower.applied),
            "changes": [change.describe(position) for position, change in recent],
        }
    )


async def reload_through_log(member: Member) -> None:
    """SIGHUP in a fleet: a reload made as an admin change (every replica re-reads its file)."""
    change = Change("POST", "/admin/reload", replica=member.id, caller="SIGHUP", at=time.time())
    try:
        done = await member.submit(change)
    except FleetLogUnavailable as exc:
        log.warning("reload_refused", error=exc.message)
        return
    log.info("reload_logged", position=str(done.position), replicas=done.spread.header())


async def list_keys(request: web.Request) -> web.Response:
    """``GET /admin/keys``: the API keys in force (name, tier, where from, a hash prefix,
    labels, expiry, its budget with what it spent this day and month)."""
    limiter = request.app[GATEWAY][LIMITER]
    keys = [
        {**doc, "budget": await limiter.budget_view(doc["name"], limiter.auth.budget(doc["name"]))}
        for doc in limiter.auth.listing()
    ]
    return web.json_response({"keys": keys})


_USAGE_DAYS: Final = 31
_MAX_USAGE_DAYS: Final = 93


async def key_usage(request: web.Request) -> web.Response:
    """``GET /admin/keys/{name}/usage?days=N``: the key's budget and what it spent in each
    period, and its tokens by day (the last N, default 31) and model."""
    try:
        days = int(request.query.get("days", _USAGE_DAYS))
    except ValueError:
        raise InvalidRequest("days: a whole number of days.") from None
    if not 1 <= days <= _MAX_USAGE_DAYS:
        raise InvalidRequest(f"days: 1 to {_MAX_USAGE_DAYS}.")
    limiter = request.app[GATEWAY][LIMITER]
    return web.json_response(await limiter.usage(request.match_info["name"], days))
