"""A setting of the pure code: its default, bounds and one-line description, declared once.

A frozen dataclass of the pure layers (a policy's config, the circuit breaker's policy, ...)
declares each field an operator may set with ``field(default=..., metadata=spec(description,
ge=...))`` (the standard ``dataclasses.field``, so a compiler of dataclasses sees the default as
it is: mypyc), and
calls ``check_settings(self)`` in ``__post_init__``. The configuration (``gateway.config``)
builds its pydantic fields from these declarations and builds the dataclasses from its
sections, so the settings file and the code cannot disagree on a default or a bound. Checks
that involve several fields stay in the dataclass's ``__post_init__``; the configuration runs
them too, by building the dataclass.

Plain dataclass metadata, so the pure layers import nothing of pydantic.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, fields
from typing import Any, Final

# The key of a setting's ``Spec`` in its dataclass field's metadata.
SETTING: Final = "setting"


@dataclass(frozen=True, slots=True)
class Spec:
    """What a setting may be, beyond its type, and what it is for."""

    description: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def bounds(self) -> dict[str, float]:
        """The bounds that are set, by pydantic's names (``ge``, ``gt``, ``le``, ``lt``)."""
        named = {"ge": self.ge, "gt": self.gt, "le": self.le, "lt": self.lt}
        return {k: v for k, v in named.items() if v is not None}

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is out of bounds (None: it is not). Written ``not (a >= b)`` so NaN
        is out of any bound."""
        if value is None:
            return None
        if self.ge is not None and not value >= self.ge:
            return f"at least {self.ge}"
        if self.gt is not None and not value > self.gt:
            return f"greater than {self.gt}"
        if self.le is not None and not value <= self.le:
            return f"at most {self.le}"
        if self.lt is not None and not value < self.lt:
            return f"less than {self.lt}"
        return None


def spec(
    description: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> dict[str, Spec]:
    """A dataclass field's metadata that makes it a setting an operator may set: its bounds and
    what it is for (``field(default=..., metadata=spec(...))``)."""
    return {SETTING: Spec(description, ge, gt, le, lt)}


def settings_of(cls: type) -> dict[str, tuple[Any, Spec]]:
    """The settings ``cls`` declares: name -> (default, spec), in field order."""
    found: tuple[Field[Any], ...] = fields(cls)
    return {f.name: (f.default, f.metadata[SETTING]) for f in found if SETTING in f.metadata}


def check_settings(obj: object) -> None:
    """Raise ``ValueError`` naming the first of ``obj``'s settings that is out of bounds."""
    for name, (_, spec) in settings_of(type(obj)).items():
        value = getattr(obj, name)
        problem = spec.problem(value)
        if problem is not None:
            raise ValueError(f"{name} must be {problem}, got {value!r} ({spec.description})")
