"""Changes the gateway makes itself (a rollout driver's decision, the capacity manager's),
appended to the fleet's log like an operator's."""

from __future__ import annotations

import json
import time
from typing import Any

from backends.errors import Conflict
from gateway.admin.action import Action, Params
from gateway.fleet.changes import Change
from gateway.request.services import Services


async def submit_own(
    svc: Services, action: Action, params: Params, body: dict[str, Any], caller: str
) -> None:
    """``action`` (with ``params``, ``body``) appended to the fleet's log and applied by every
    replica (this one's answer awaited), or, without a fleet, applied here. Raises the refusal
    (``GatewayError``) or the log's failure."""
    body = {**body, "at": time.time()}
    member = svc.fleet
    if member is None:
        action.apply(svc, params, body)
        return
    change = Change(
        method=action.method,
        path=action.pattern.format(**params),
        body=json.dumps(body).encode(),
        replica=member.id,
        caller=caller,
        at=body["at"],
        old=action.before(svc, params),
        new=action.check(svc, params, body),
    )
    # Applied here is enough: the driver renews its lease each turn, so it must not wait for
    # every replica (a dead one stays in the registry until its report expires).
    outcome = await member.append(change)
    if outcome is not None and outcome.status >= 400:
        raise Conflict(f"the fleet refused the change: {outcome.body[:200]!r}")
