"""Faults injected on demand: a frozen value, replaced whole when changed.

``Faults.updated(patch)`` validates a JSON patch (the admin endpoint's body) and
returns the new value; unknown keys and wrong types are rejected, so a typo in a
load-test script fails loudly instead of silently doing nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class FaultsError(ValueError):
    """A faults patch that cannot be applied."""


@dataclass(frozen=True, slots=True)
class Faults:
    """What is currently wrong with the simulated backend (nothing, by default)."""

    slowdown: float = 1.0  # multiplies every step's duration (a slow GPU)
    error_rate: float = 0.0  # fraction of generate requests answered with error_status
    error_status: int = 500
    hang_before_first_byte: bool = False  # generate requests get no answer at all
    hang_after_tokens: int | None = None  # streams stall after this many tokens
    refuse_connections: bool = False  # the listening socket is closed
    unhealthy: bool = False  # /health and /ping answer 503

    def __post_init__(self) -> None:
        if not self.slowdown > 0:
            raise FaultsError("slowdown must be positive")
        if not 0.0 <= self.error_rate <= 1.0:
            raise FaultsError("error_rate must be between 0 and 1")
        if not 400 <= self.error_status <= 599:
            raise FaultsError("error_status must be an HTTP error status (400-599)")
        if self.hang_after_tokens is not None and self.hang_after_tokens < 0:
            raise FaultsError("hang_after_tokens must not be negative")

    def updated(self, patch: Mapping[str, Any]) -> Faults:
        """This value with the fields in ``patch`` changed, each type-checked."""
        changes: dict[str, Any] = {}
        for key, value in patch.items():
            kind = _FIELD_KINDS.get(key)
            if kind is None:
                raise FaultsError(f"unknown fault {key!r}; known: {sorted(_FIELD_KINDS)}")
            changes[key] = _coerce(key, kind, value)
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELD_KINDS: dict[str, str] = {
    "slowdown": "float",
    "error_rate": "float",
    "error_status": "int",
    "hang_before_first_byte": "bool",
    "hang_after_tokens": "int|None",
    "refuse_connections": "bool",
    "unhealthy": "bool",
}


def _coerce(key: str, kind: str, value: Any) -> Any:
    if kind == "bool":
        if isinstance(value, bool):
            return value
    elif value is None:
        if kind.endswith("|None"):
            return None
    elif isinstance(value, bool):
        pass  # bool is an int subclass, but never a valid number here
    elif kind.startswith("int"):
        if isinstance(value, int):
            return value
    elif isinstance(value, int | float):
        return float(value)
    raise FaultsError(f"{key} must be of type {kind}, got {value!r}")
