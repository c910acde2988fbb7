"""Prometheus text with its labels, for the soak's checks. Pure.

``loadtest.promtext`` sums a family over its label sets; the soak needs single series (one
backend's in-flight gauge, the client-disconnect reason of the abort counter) and the number
of series on the page (a page that grows for ever is a leak).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

_SAMPLE: Final = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)")
_LABEL: Final = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def samples(text: str) -> list[Sample]:
    """Every sample line of a Prometheus text page (comments and NaN values left out)."""
    out: list[Sample] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isnan(value):
            continue
        labels = {
            k: v.replace('\\"', '"').replace("\\\\", "\\")
            for k, v in _LABEL.findall(m.group(2) or "")
        }
        out.append(Sample(m.group(1), labels, value))
    return out


def series_count(text: str) -> int:
    """The number of sample lines: what a scrape stores, and what must not grow for ever."""
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def total(found: Iterable[Sample], name: str, **match: str) -> float:
    """The sum of ``name``'s samples whose labels include ``match``."""
    return sum(
        s.value
        for s in found
        if s.name == name and all(s.labels.get(k) == v for k, v in match.items())
    )


def by_label(found: Iterable[Sample], name: str, label: str) -> dict[str, float]:
    """``name``'s samples summed per value of ``label``."""
    out: dict[str, float] = {}
    for s in found:
        if s.name == name:
            key = s.labels.get(label, "")
            out[key] = out.get(key, 0.0) + s.value
    return out
