"""The production configuration, rewritten for one soak run. Pure: a document in, a document out.

``rewrite`` keeps ``deploy/gateway.production.toml`` as it is (keys, tiers, pools, alias,
admission queue, prefix affinity, tracing, Redis store, admin port) and changes only where it
runs: the backend URLs (the names stay), the Redis URL and a key prefix of the run's own, the
OTLP endpoint, the listening addresses and ports, the log level, and health probes fast enough
for a test. ``dumps`` writes the result back as TOML (the standard library only reads it).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

PRODUCTION_TOML: Final = Path(__file__).resolve().parents[2] / "deploy/gateway.production.toml"
# The example keys of the production file (their hashes are in it), by key name.
API_KEYS: Final = {
    "web-app": "sk-prod-interactive-example",
    "nightly-batch": "sk-prod-batch-example",
    "internal-tools": "sk-prod-internal-example",
}
BACKENDS: Final = ("gpu-a", "gpu-b", "gpu-canary")
ALIAS: Final = "chat"
SERVED_MODEL: Final = "llama"
# Probes fast enough that a dead backend is seen in ~1.5 s (fall = 3) and back in ~1 s.
TEST_HEALTH: Final = {"interval": 0.5, "timeout": 0.5}


class SoakConfigError(ValueError):
    """A production file this runner cannot run (names it relies on are missing)."""


def rewrite(
    doc: Mapping[str, Any],
    *,
    sims: Mapping[str, str],
    redis_url: str,
    key_prefix: str,
    otlp_endpoint: str,
    port: int,
    admin_port: int,
    aliases: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, Any]:
    """``doc`` pointed at this run's processes; ``sims`` maps backend name to URL."""
    out = copy.deepcopy(dict(doc))
    names = [b.get("name") for b in out.get("backends", []) if isinstance(b, dict)]
    if sorted(n for n in names if n) != sorted(sims):
        raise SoakConfigError(f"the file's backends are {names}, the runner has {sorted(sims)}")
    out["backends"] = [{"url": sims[n], "name": n} for n in names if n]
    out["host"] = "127.0.0.1"
    out["port"] = port
    out["log_level"] = "warning"
    out["log_format"] = "json"
    out["admin"] = {**out.get("admin", {}), "host": "127.0.0.1", "port": admin_port}
    out["tracing"] = {**out.get("tracing", {}), "otlp_endpoint": otlp_endpoint}
    out["health"] = {**out.get("health", {}), **TEST_HEALTH}
    limits = out.setdefault("limits", {})
    if limits.get("store") != "redis":
        raise SoakConfigError("the production file must use the Redis limit store")
    limits["redis"] = {**limits.get("redis", {}), "url": redis_url, "key_prefix": key_prefix}
    if aliases is not None:
        out["aliases"] = {a: dict(w) for a, w in aliases.items()}
    if ALIAS not in out.get("aliases", {}):
        raise SoakConfigError(f"the production file has no alias {ALIAS!r}")
    return out


def tier_of(doc: Mapping[str, Any], key_name: str) -> dict[str, Any]:
    """The limits tier of the API key called ``key_name``."""
    limits = doc.get("limits", {})
    for k in limits.get("keys", []):
        if k.get("name") == key_name:
            tier: dict[str, Any] = limits.get("tiers", {}).get(k.get("tier", "default"), {})
            return tier
    raise SoakConfigError(f"no key {key_name!r} in [[limits.keys]]")


# -- TOML out ---------------------------------------------------------------------------------

_BARE_KEY: Final = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE_KEY.match(k) else _string(k)


def _string(s: str) -> str:
    out = s.replace("\\", "\\\\").replace('"', '\\"')
    out = "".join(c if c >= " " or c == "\t" else f"\\u{ord(c):04x}" for c in out)
    return f'"{out}"'


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise SoakConfigError(f"TOML has no {v!r} this runner would write")
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    raise SoakConfigError(f"cannot write {type(v).__name__} as TOML")


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _table(lines: list[str], path: list[str], table: Mapping[str, Any], *, array: bool) -> None:
    if path:
        name = ".".join(_key(p) for p in path)
        lines.append(f"[[{name}]]" if array else f"[{name}]")
    subs: list[tuple[str, Any]] = []
    for k, v in table.items():
        if isinstance(v, dict) or _is_table_array(v):
            subs.append((k, v))
        else:
            lines.append(f"{_key(k)} = {_value(v)}")
    for k, v in subs:
        lines.append("")
        if isinstance(v, dict):
            _table(lines, [*path, k], v, array=False)
        else:
            for i, item in enumerate(v):
                if i:
                    lines.append("")
                _table(lines, [*path, k], item, array=True)


def dumps(doc: Mapping[str, Any]) -> str:
    """``doc`` as TOML text that ``tomllib.loads`` reads back equal."""
    lines: list[str] = []
    _table(lines, [], doc, array=False)
    return "\n".join(lines).strip() + "\n"
