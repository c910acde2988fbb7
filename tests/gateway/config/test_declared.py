"""The configuration and the pure code agree on every setting: each one the pure code declares
(``policies.setting``) is a field of exactly one section, with the same type, default, bounds
and description, and the section refuses what the code refuses."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from pydantic import ValidationError

import backends
import policies
from gateway.config.declared import Section, build
from gateway.config.settings import Settings
from gateway.limits import retry_budget
from gateway.request import retry
from policies import AffinityConfig
from policies.setting import Spec, settings_of

DOCS = Path(__file__).resolve().parents[3] / "docs"


def _modules(package: ModuleType) -> list[ModuleType]:
    found = [package]
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        found.append(importlib.import_module(info.name))
    return found


def _declaring_classes() -> set[type]:
    """Every class of the pure code (and the request path's retry policy and budget) that
    declares a setting."""
    found: set[type] = set()
    for module in [*_modules(policies), *_modules(backends), retry, retry_budget]:
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and _is_dataclass(cls) and settings_of(cls):
                found.add(cls)
    return found


def _is_dataclass(cls: type) -> bool:
    return hasattr(cls, "__dataclass_fields__")


def _sections() -> list[type[Section]]:
    seen: list[type[Section]] = []
    todo = list(Section.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return seen


def _bounds(metadata: list[Any]) -> dict[str, float]:
    names = ("ge", "gt", "le", "lt")
    return {n: getattr(m, n) for m in metadata for n in names if hasattr(m, n)}


def test_every_setting_of_the_pure_code_is_one_field_with_its_type_default_bounds_and_text() -> (
    None
):
    exposed: dict[tuple[type, str], type[Section]] = {}
    for section in _sections():
        for owner, prefix in (*section.builds, *section.also_declares):
            hints = typing.get_type_hints(owner)
            for name, (default, spec) in settings_of(owner).items():
                key = (owner, name)
                assert key not in exposed, f"{owner.__name__}.{name} is exposed twice"
                exposed[key] = section
                where = f"{section.__name__}.{prefix + name}"
                assert prefix + name in section.model_fields, f"{where} is missing"
                field = section.model_fields[prefix + name]
                assert field.annotation == hints[name], where
                assert field.default == default, where
                assert field.description == spec.description, where
                assert _bounds(field.metadata) == spec.bounds(), where
    declared = {(cls, name) for cls in _declaring_classes() for name in settings_of(cls)}
    assert set(exposed) == declared


def test_the_settings_every_section_holds_by_default_are_the_code_s_defaults() -> None:
    for section in _sections():
        for owner, prefix in section.builds:
            built = build(owner, section(), prefix=prefix)
            for name, (default, _) in settings_of(owner).items():
                assert getattr(built, name) == default, f"{owner.__name__}.{name}"


def test_the_discovery_finds_the_settings_it_is_meant_to_check() -> None:
    names = {cls.__name__ for cls in _declaring_classes()}
    assert {"AffinityConfig", "PredictionConfig", "Weights", "CircuitPolicy"} <= names


@pytest.mark.parametrize(
    ("section", "bad", "named"),
    [
        ("affinity", {"index_capacity": 128, "max_blocks": 256}, "index_capacity"),
        ("affinity", {"block_chars": 4}, "block_chars"),
        ("latency", {"rescue_factor": 0.5}, "rescue_factor"),
        ("latency", {"explore": 1.0}, "explore"),
        ("health", {"circuit_growth": 0.5}, "circuit_growth"),
        ("retry", {"jitter": 2}, "jitter"),
    ],
)
def test_a_value_the_code_refuses_is_refused_by_the_settings_naming_the_field(
    section: str, bad: dict[str, float], named: str
) -> None:
    with pytest.raises(ValidationError, match=named):
        Settings.model_validate({section: bad})


def test_the_code_refuses_a_value_out_of_a_declared_bound_naming_it() -> None:
    with pytest.raises(ValueError, match=r"block_chars must be at least 8, got 4 \(prompt"):
        AffinityConfig(block_chars=4)


def test_nan_is_out_of_any_bound() -> None:
    assert Spec("x", ge=0).problem(float("nan")) == "at least 0"


def test_the_affinity_docs_list_the_code_s_defaults() -> None:
    table = (DOCS / "prefix-affinity.md").read_text()
    listed = dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", table, flags=re.MULTILINE))
    for name, (default, _) in settings_of(AffinityConfig).items():
        text = listed[name].strip("`").replace(",", "")
        if default is None:
            assert text == "none", name
        elif isinstance(default, str):
            assert text == default, name
        else:
            assert float(text) == default, name
