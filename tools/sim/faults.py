"""Faults injected on demand: a frozen value, replaced whole when changed.

``Faults.updated(patch)`` validates a JSON patch (the admin endpoint's body) and
returns the new value; unknown keys and wrong types are rejected, so a typo in a
load-test script fails loudly instead of silently doing nothing.

Three faults stop a stream mid-way, each after its stream has sent N tokens (checked
before every token, so one set at run time hits the streams already past N at their
next token): ``hang_after_tokens`` (the stream stands still, its connection open, as a
hung engine looks from outside), ``break_after_tokens`` (the connection is reset, as when
the server is killed) and ``error_after_tokens`` (vLLM's mid-stream error event, then
``[DONE]``, as when the engine fails; each API's own: a Messages stream's is ``event:
error``). ``stream_stop`` says which one applies; the first threshold reached wins, and
on a tie break before error before hang. A break or an error aborts the generation at
once, freeing its engine slot; a hung stream's is freed when its client gives up.
Non-streaming requests are left alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

StreamStop = Literal["break", "error", "hang"]


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
    break_after_tokens: int | None = None  # streams' connections reset after this many
    error_after_tokens: int | None = None  # streams end with an error event after this many
    refuse_connections: bool = False  # the listening socket is closed
    unhealthy: bool = False  # /health and /ping answer 503

    def __post_init__(self) -> None:
        if not self.slowdown > 0:
            raise FaultsError("slowdown must be positive")
        if not 0.0 <= self.error_rate <= 1.0:
            raise FaultsError("error_rate must be between 0 and 1")
        if not 400 <= self.error_status <= 599:
            raise FaultsError("error_status must be an HTTP error status (400-599)")
        for name, after in self._stream_stops():
            if after is not None and after < 0:
                raise FaultsError(f"{name}_after_tokens must not be negative")

    def _stream_stops(self) -> tuple[tuple[StreamStop, int | None], ...]:
        return (
            ("break", self.break_after_tokens),
            ("error", self.error_after_tokens),
            ("hang", self.hang_after_tokens),
        )

    def stream_stop(self, sent: int) -> StreamStop | None:
        """The fault that stops a stream which has sent ``sent`` tokens, before its next."""
        for stop, after in self._stream_stops():
            if after is not None and sent >= after:
                return stop
        return None

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
    "break_after_tokens": "int|None",
    "error_after_tokens": "int|None",
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
