"""Token budgets: tokens per UTC day and per UTC month, for a key (set at run time) or for each
key of a tier (configured). Pure: the periods, the names their counts go under, when they reset.

A budget is counted per caller (``Principal.id``: ``key:<name>``, or ``anonymous`` for every
anonymous caller together), one count per period (``day:2026-12-05``, ``month:2026-12``), so
changing a key's budget keeps what it spent in the period, rotating its secret too, and a new
day or month starts from zero on every replica at once (the replicas' clocks, in UTC). The
store keeps the counts (``LimitStore.charge_budget``): in memory for one process, on Redis for
a fleet, where they outlive the gateway.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal

from backends.errors import InvalidRequest

Period = Literal["day", "month"]
PERIODS: Final[tuple[Period, ...]] = ("day", "month")
FIELDS: Final = {"day": "tokens_per_day", "month": "tokens_per_month"}


@dataclass(frozen=True, slots=True)
class Counted:
    """One period's count a request is charged to: its name in the store and its limit."""

    period: Period
    name: str
    limit: int


@dataclass(frozen=True, slots=True)
class Budget:
    per_day: int | None = None
    per_month: int | None = None
    source: str = "key"  # "key": set for the key; "tier": its tier's

    def __post_init__(self) -> None:
        for limit in (self.per_day, self.per_month):
            if limit is not None and limit < 1:
                raise ValueError("a budget is a positive number of tokens")

    @property
    def empty(self) -> bool:
        return self.per_day is None and self.per_month is None

    def limit(self, period: Period) -> int | None:
        return self.per_day if period == "day" else self.per_month

    def counted(self, now: float) -> list[Counted]:
        """The counts a request made at ``now`` is charged to."""
        return [
            Counted(period, count_name(period, now), limit)
            for period in PERIODS
            if (limit := self.limit(period)) is not None
        ]

    def to_json(self) -> dict[str, Any]:
        return {"tokens_per_day": self.per_day, "tokens_per_month": self.per_month}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], source: str = "key") -> Budget | None:
        """From ``{"tokens_per_day": N|null, "tokens_per_month": N|null}``; None when neither
        is set. ``InvalidRequest`` for anything else."""
        unknown = sorted(set(doc) - set(FIELDS.values()))
        if unknown:
            raise InvalidRequest(
                f"Unknown budget field(s): {', '.join(unknown)}; a budget is "
                '{"tokens_per_day": N, "tokens_per_month": N} (null: none for that period).'
            )
        limits: dict[str, int | None] = {}
        for name in FIELDS.values():
            value = doc.get(name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise InvalidRequest(f"{name}: a positive whole number of tokens, or null.")
            limits[name] = value
        budget = cls(limits["tokens_per_day"], limits["tokens_per_month"], source)
        return None if budget.empty else budget


def count_name(period: Period, now: float) -> str:
    """``day:YYYY-MM-DD`` or ``month:YYYY-MM``, in UTC."""
    t = time.gmtime(now)
    if period == "day":
        return f"day:{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}"
    return f"month:{t.tm_year:04d}-{t.tm_mon:02d}"


def day_of(now: float) -> str:
    """The UTC day, ``YYYY-MM-DD`` (what per-model usage is kept by)."""
    return count_name("day", now).removeprefix("day:")


def days_back(now: float, n: int) -> list[str]:
    """The last ``n`` UTC days, today first."""
    return [day_of(now - i * 86_400) for i in range(n)]


def resets_at(period: Period, now: float) -> float:
    """When the period that holds ``now`` ends (Unix time): the next UTC midnight, or the first
    of the next month."""
    t = time.gmtime(now)
    if period == "day":
        return calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0)) + 86_400.0
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return float(calendar.timegm((year, month, 1, 0, 0, 0)))


def iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")
