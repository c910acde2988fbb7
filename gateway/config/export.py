"""The running state written back into the configuration file, so that what the fleet's admin
changes made (aliases moved by a rollout, policy and weights, drained backends and pools, keys
made, changed and revoked, their budgets and limits, capacity rules) can be committed. Pure: the
file's text and the running state in, TOML out.

The file's own text is the start (tomlkit keeps its comments, order and layout); only the
settings the admin changes move are rewritten, each where the file has it (a ``[limits]``
table's ``[[limits.keys]]`` or an inline ``limits = {keys = [...]}``). What the file cannot
hold is said in comments at the top: a key whose old secret still works after a rotation, a
rollout under way. Secrets never appear: keys are written by their hashes, as the file keeps
them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import tomlkit
from tomlkit.items import AoT, Array, InlineTable

REDACTED: Final = "REDACTED: set it again (the export never writes a secret)"
# Where the file may hold a secret (the settings' SecretStr fields); "*": every entry of a list
SECRETS: Final = (
    ("admin", "token"),
    ("limits", "redis", "url"),
    ("backends", "*", "api_key"),
    ("discovery", "api_key"),
)


@dataclass(frozen=True, slots=True)
class Running:
    """What the admin changes set, as a replica has it now."""

    policy: str
    weights: Mapping[str, float] | None
    aliases: Mapping[str, Mapping[str, float]]
    drained_backends: frozenset[str]  # by the id [[backends]] gives them (name, else url)
    drained_pools: frozenset[str]
    keys: Sequence[Mapping[str, Any]]  # as [[limits.keys]] entries
    notes: Sequence[str] = field(default_factory=tuple)
    # [capacity.models]: each managed model's rule (PUT/DELETE /admin/capacity/{model})
    capacity_rules: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


HEADER_MARK: Final = "llm-gateway state export"  # in the header's first line


def running_toml(file_text: str | None, running: Running, *, header: str) -> str:
    """``file_text`` (None: no file, a new one) with the running state written in, under
    ``header`` (an earlier export's header replaced, not piled up)."""
    doc = tomlkit.parse(_without_header(file_text or ""))
    doc["policy"] = running.policy
    if running.weights is not None:
        _set_table(doc, "weights", {k: _number(v) for k, v in running.weights.items()})
    _set_table(
        doc,
        "aliases",
        {
            alias: _inline({p: _number(w) for p, w in ws.items()})
            for alias, ws in running.aliases.items()
        },
    )
    for entry in _entries(doc, "backends"):
        url = str(entry.get("url", ""))
        ident = str(entry.get("name") or url.split("://", 1)[-1])  # BackendSettings.id
        _flag(entry, "drain", ident in running.drained_backends)
    for entry in _entries(doc, "pools"):
        _flag(entry, "drain", str(entry.get("name", "")) in running.drained_pools)
    _set_keys(doc, running.keys)
    _set_capacity(doc, running.capacity_rules)
    hidden = [".".join(p) for p in SECRETS if _redact(doc, p)]
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines += [f"# NOTE: {note}" for note in running.notes]
    if hidden:
        lines.append(f"# NOTE: secrets not written, to set again: {', '.join(hidden)}")
    body = tomlkit.dumps(doc)
    return "\n".join(lines) + "\n\n" + body.lstrip("\n")


def _set_capacity(doc: Any, rules: Mapping[str, Mapping[str, Any]]) -> None:
    """``[capacity.models]`` as running (left out of a file without them, when none run)."""
    capacity = doc.get("capacity")
    if capacity is None:
        if not rules:
            return
        capacity = doc["capacity"] = tomlkit.table()
    models = tomlkit.table()
    for model, rule in rules.items():
        models[model] = _inline({k: v for k, v in rule.items() if v is not None})
    capacity["models"] = models


def _without_header(text: str) -> str:
    lines = text.splitlines(keepends=True)
    if not lines or HEADER_MARK not in lines[0]:
        return text
    end = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    return "".join(lines[end:]).lstrip("\n")


def key_entry(name: str, doc: Mapping[str, Any]) -> dict[str, Any]:
    """A key's record (``KeyRecord.to_json``) as a ``[[limits.keys]]`` entry."""
    entry: dict[str, Any] = {"name": name, "hash": f"sha256:{doc['hash']}", "tier": doc["tier"]}
    if doc.get("labels"):
        entry["labels"] = dict(doc["labels"])
    if doc.get("expires_at") is not None:
        at = datetime.fromtimestamp(float(doc["expires_at"]), UTC)
        entry["expires_at"] = at.isoformat().replace("+00:00", "Z")
    budget = doc.get("budget") or {}
    for period in ("tokens_per_day", "tokens_per_month"):
        if budget.get(period) is not None:
            entry[period] = int(budget[period])
    if doc.get("limits"):
        entry["limits"] = {k: int(v) for k, v in doc["limits"].items()}
    return entry


def _redact(node: Any, path: Sequence[str]) -> bool:
    """Replace the value at ``path`` under ``node`` (if there) with ``REDACTED``."""
    head, *rest = path
    if head == "*":
        found = [_redact(item, rest) for item in (node if isinstance(node, list) else [])]
        return any(found)
    if not hasattr(node, "get") or node.get(head) is None:
        return False
    if not rest:
        node[head] = REDACTED
        return True
    return _redact(node[head], rest)


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else float(value)


def _inline(values: Mapping[str, Any]) -> InlineTable:
    table = tomlkit.inline_table()
    table.update(values)
    return table


def _set_table(doc: Any, name: str, values: Mapping[str, Any]) -> None:
    """``values`` as ``name``, in the form the file has it (a table, or an inline one)."""
    current = doc.get(name)
    if isinstance(current, InlineTable):
        doc[name] = _inline(values)
        return
    table = tomlkit.table()
    table.update(values)
    doc[name] = table


def _entries(doc: Any, name: str) -> list[Any]:
    found = doc.get(name)
    if isinstance(found, AoT | Array | list):
        return list(found)
    return []


def _flag(entry: Any, name: str, on: bool) -> None:
    if on:
        entry[name] = True
    elif name in entry:
        del entry[name]


def _set_keys(doc: Any, keys: Sequence[Mapping[str, Any]]) -> None:
    limits = doc.get("limits")
    if limits is None:
        if not keys:
            return
        limits = tomlkit.table()
        doc["limits"] = limits
    if isinstance(limits, InlineTable) or isinstance(limits.get("keys"), Array):
        array = tomlkit.array()
        for key in keys:
            array.append(
                _inline({k: _inline(v) if isinstance(v, dict) else v for k, v in key.items()})
            )
        if len(keys) > 1:
            array.multiline(True)
        limits["keys"] = array
        return
    aot = tomlkit.aot()
    for key in keys:
        table = tomlkit.table()
        table.update({k: _inline(v) if isinstance(v, dict) else v for k, v in key.items()})
        aot.append(table)
    if keys:
        limits["keys"] = aot
    elif "keys" in limits:
        del limits["keys"]
