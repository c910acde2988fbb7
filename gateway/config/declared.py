"""Settings declared by the pure code: the configuration's fields, and the dataclasses built
back from them.

A frozen dataclass of ``policies`` or ``backends`` declares each setting it takes once
(``policies.setting``: default, bounds, description). A section of the configuration names
its fields and their types, takes each field's default, bounds and description from there
(``declared``), and is checked by building the dataclass (``Section``), so a check that spans
fields (``index_capacity`` at least ``max_blocks``) is written once too. The code is then
given the dataclass, built by name (``build``), never copied field by field.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.setting import settings_of

T = TypeVar("T")


def declared(owner: type, name: str) -> Any:
    """The pydantic field for ``owner``'s setting ``name``: its default, bounds and
    description."""
    default, spec = settings_of(owner)[name]
    return Field(
        default, description=spec.description, ge=spec.ge, gt=spec.gt, le=spec.le, lt=spec.lt
    )


def build(cls: type[T], section: BaseModel, *, prefix: str = "") -> T:
    """``cls`` from ``section``: each of its settings from the section's field of the same
    name (after ``prefix``); what the section does not set keeps ``cls``'s own default."""
    return cls(**{name: getattr(section, prefix + name) for name in settings_of(cls)})


class Section(BaseModel):
    """A section of the configuration holding settings of the pure code's dataclasses
    (``builds``: each with the prefix of its fields here). Validating the section builds
    each, so their own checks refuse what they would refuse, in the section's error.
    ``also_declares``: dataclasses it holds settings of that need more than settings to be
    built (a policy, built with its index); their fields' bounds are all they check."""

    model_config = ConfigDict(extra="forbid")

    builds: ClassVar[tuple[tuple[type, str], ...]] = ()
    also_declares: ClassVar[tuple[tuple[type, str], ...]] = ()

    @model_validator(mode="after")
    def _check_by_building(self) -> Self:
        for cls, prefix in self.builds:
            build(cls, self, prefix=prefix)
        return self
