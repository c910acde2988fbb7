"""Who is served next from the admission queue, and when the fleet counts as full. Pure.

Order: the highest priority band first; within a band, round robin across API keys (a key
that has waiters takes one turn per rotation, so a burst of a hundred from one key delays a
quiet key's single request by at most one turn per other waiting key); within a key, FIFO.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from gateway.limits.settings import AdmissionSettings
from policies import BackendSnapshot

T = TypeVar("T", bound=Hashable)


class FairQueue(Generic[T]):
    __slots__ = ("_bands", "_where")

    def __init__(self) -> None:
        self._bands: dict[int, OrderedDict[str, deque[T]]] = {}
        self._where: dict[T, tuple[int, str]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item: T) -> bool:
        return item in self._where

    def push(self, item: T, key: str, priority: int = 0) -> None:
        if item in self._where:
            raise ValueError("item is already queued")
        band = self._bands.setdefault(priority, OrderedDict())
        band.setdefault(key, deque()).append(item)  # a new key joins the rotation at its end
        self._where[item] = (priority, key)

    def pop(self) -> T | None:
        """The next item to serve, taken out of the queue; ``None`` when empty."""
        if not self._bands:
            return None
        priority = max(self._bands)
        band = self._bands[priority]
        key, items = next(iter(band.items()))
        item = items.popleft()
        if items:
            band.move_to_end(key)
        else:
            del band[key]
            if not band:
                del self._bands[priority]
        del self._where[item]
        return item

    def remove(self, item: T) -> bool:
        """Take ``item`` out wherever it is; False if it was not queued."""
        where = self._where.pop(item, None)
        if where is None:
            return False
        priority, key = where
        band = self._bands[priority]
        items = band[key]
        items.remove(item)
        if not items:
            del band[key]
            if not band:
                del self._bands[priority]
        return True

    def ahead_of(self, priority: int) -> int:
        """Items a new one of ``priority`` would wait behind (those of its band or above)."""
        return sum(
            sum(len(items) for items in band.values())
            for p, band in self._bands.items()
            if p >= priority
        )

    def lowest_priority(self) -> int | None:
        return min(self._bands) if self._bands else None

    def lowest(self) -> tuple[T, int] | None:
        """The item to shed first, and its priority: the lowest band's newest (of the key
        with the most waiting there), taken out; None when empty."""
        if not self._bands:
            return None
        priority = min(self._bands)
        band = self._bands[priority]
        key = max(band, key=lambda k: len(band[k]))
        item = band[key][-1]
        self.remove(item)
        return item, priority

    def waiting_by_key(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, key in self._where.values():
            out[key] = out.get(key, 0) + 1
        return out


def parse_priority(
    value: str | None, max_priority: int, *, floor: int = -100, default: int = 0
) -> int:
    """The priority header's value, clamped to what the caller's tier allows (``default``,
    the tier's own, when there is none or it is no integer)."""
    if value is None:
        return default
    try:
        p = int(value.strip())
    except ValueError:
        return default
    return max(floor, min(p, max_priority))


@dataclass(frozen=True, slots=True)
class SaturationThresholds:
    """A backend is saturated when it reaches any configured threshold."""

    max_queue_depth: int | None = None
    max_kv_usage: float | None = None
    max_in_flight: int | None = None

    @classmethod
    def from_settings(cls, s: AdmissionSettings) -> SaturationThresholds:
        return cls(s.max_queue_depth, s.max_kv_usage, s.max_in_flight)

    @property
    def configured(self) -> bool:
        return (
            self.max_queue_depth is not None
            or self.max_kv_usage is not None
            or self.max_in_flight is not None
        )


def backend_saturated(s: BackendSnapshot, th: SaturationThresholds) -> bool:
    if th.max_in_flight is not None and s.in_flight >= th.max_in_flight:
        return True
    if (
        th.max_queue_depth is not None
        and s.queue_depth is not None
        and s.queue_depth >= th.max_queue_depth
    ):
        return True
    return (
        th.max_kv_usage is not None
        and s.kv_cache_usage is not None
        and s.kv_cache_usage >= th.max_kv_usage
    )


def fleet_saturated(snapshots: Sequence[BackendSnapshot], th: SaturationThresholds) -> bool:
    """Every routable backend is saturated (no backends: not saturated, the router answers)."""
    return bool(snapshots) and all(backend_saturated(s, th) for s in snapshots)
