"""The running state back to the file, and what a reload would change.

- ``GET /admin/state``: the configuration file (``--config``) with what is running written in
  (``gateway.config.export``): aliases as a rollout left them, policy and weights, drained
  backends and pools, keys by their hashes with their budgets and limits, revoked ones gone.
  ``application/toml``; ``llm-gateway state export`` fetches it. Read-only, from this replica
  (every replica applied the same log: in a fleet, any of them answers the same).
- ``POST /admin/reload?dry_run=1`` (``reload_plan``): what a reload would change in what is
  running, setting by setting; nothing is changed and nothing is logged.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from backends.errors import InvalidRequest
from gateway.admin.context import admin_of
from gateway.admin.reload import describe_policy, live, read_settings
from gateway.capacity.settings import rule_doc
from gateway.config.export import HEADER_MARK, Running, key_entry, running_toml
from gateway.config.settings import FileLoader
from gateway.request.services import Services


def running(svc: Services) -> Running:
    """What the admin changes set, as this replica has it now."""
    policy = describe_policy(svc)
    rollout = svc.rollout
    keys = svc.limiter.auth.records()
    notes = []
    for name, doc in keys.items():
        if doc.get("previous_until"):
            until = datetime.fromtimestamp(float(doc["previous_until"]), UTC).isoformat()
            notes.append(f"key {name!r} was rotated: its old secret still works until {until}")
    for run in svc.rollouts.now.active():
        notes.append(
            f"a rollout of {run.plan.alias!r} is under way: its weights here are its step's"
        )
    return Running(
        policy=str(policy["policy"]),
        weights=policy.get("weights"),
        aliases={a: dict(w) for a, w in rollout.aliases.items()},
        drained_backends=frozenset(b.id for b in svc.pool.all() if b.draining),
        drained_pools=frozenset(rollout.drained),
        keys=[key_entry(n, d) for n, d in keys.items()],
        notes=notes,
        capacity_rules={m: rule_doc(r) for m, r in svc.capacity.rules.items()},
    )


def config_file(svc: Services) -> str | None:
    """Where the running configuration was read from, if from a file."""
    load = svc.config.load
    path = load.path if isinstance(load, FileLoader) else None
    return None if path is None else str(path)


def state_toml(svc: Services) -> str:
    path = config_file(svc)
    text = None
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise InvalidRequest(f"The configuration file cannot be read: {exc}") from exc
    member = svc.fleet
    at = datetime.fromtimestamp(time.time(), UTC).isoformat(timespec="seconds")
    where = "no file: only what the admin changes set" if path is None else path
    applied = (
        ""
        if member is None or member.follower.applied is None
        else (f", the fleet's log applied up to {member.follower.applied}")
    )
    header = (
        f"Written by {HEADER_MARK}: the running state at {at}{applied}, into {where}.\n"
        "Keys appear by their hashes; settings from the environment or the command line are "
        "not written."
    )
    return running_toml(text, running(svc), header=header)


async def get_state(request: web.Request) -> web.Response:
    """``GET /admin/state``: the configuration file with the running state written in."""
    text = state_toml(admin_of(request).svc)
    return web.Response(text=text, content_type="application/toml")


def reload_plan(svc: Services) -> dict[str, Any]:
    """What ``POST /admin/reload`` would change, without changing anything: each setting the
    file now sets otherwise, live or needing a restart, and for the routing ones what is running
    now against what the reload would set."""
    new = read_settings(svc)
    old = svc.config.current
    changes: list[dict[str, Any]] = []
    for name in type(new).model_fields:
        before, after = getattr(old, name), getattr(new, name)
        if before == after:
            continue
        entry: dict[str, Any] = {"setting": name, "live": live(name)}
        if name == "aliases":
            rollout = svc.rollout
            owned = {r.plan.alias for r in svc.rollouts.now.active()}
            entry["aliases"] = {
                alias: {"now": rollout.aliases.get(alias), "after": weights}
                for alias, weights in sorted(after.items())
                if rollout.aliases.get(alias) != weights and alias not in owned
            }
            entry["kept_by_rollouts"] = sorted(owned & set(after))
        elif name in ("policy", "weights"):
            now = describe_policy(svc)
            entry["now"] = now[name]
            entry["after"] = after if name == "policy" else after.model_dump(mode="json")
        else:
            entry["from"] = _dump(before)
            entry["to"] = _dump(after)
            if isinstance(entry["from"], dict) and isinstance(entry["to"], dict):
                keys = set(entry["from"]) | set(entry["to"])
                entry["fields"] = sorted(
                    k for k in keys if entry["from"].get(k) != entry["to"].get(k)
                )
        changes.append(entry)
    return {
        "dry_run": True,
        "file": config_file(svc),
        "changes": changes,
        "applied": [c["setting"] for c in changes if c["live"]],
        "restart_required": [c["setting"] for c in changes if not c["live"]],
    }


def _dump(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value
