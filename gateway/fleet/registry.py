"""The registry of replicas: each replica (and each worker of ``serve --workers``) reports
itself every few seconds; one that stops reporting drops out. ``Registry`` is what a replica
needs of it; ``RedisRegistry`` keeps it on the fleet's Redis, ``gateway.fleet.files`` in a
directory for the workers of one host without Redis.

On Redis, a report is one string per replica, ``<prefix><fleet>:replica:<id>``, written with
a TTL (``SET ... PX``), so Redis itself forgets a replica that died: no clock of ours decides.
The ids are also kept in a set, ``<prefix><fleet>:replicas``, for listing; an id whose report has
expired is taken out of the set by the next listing.

A report carries the replica's figures since it started (``gateway.fleet.figures``): what the
reports say together (``lagging``, ``disagreements``, the sums in ``summary``) is pure and below
the I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from redis.asyncio import Redis

from backends.errors import InvalidRequest
from gateway.fleet.changes import Position
from gateway.fleet.figures import Figures, total


@dataclass(frozen=True, slots=True)
class Report:
    """One replica as it reported itself."""

    id: str
    version: str
    address: str  # where its model endpoints listen (host:port)
    applied: str | None  # the last change-log position it applied
    started_at: float  # Unix time
    reported_at: float  # Unix time, its own clock
    in_flight: dict[str, int] = field(default_factory=dict)  # per backend id
    health: dict[str, str] = field(default_factory=dict)  # per backend id: its view
    figures: Figures = field(default_factory=Figures)  # since it started
    # The rollouts it drives: alias -> its driver's last look (``gateway.rollouts.driver``)
    driving: dict[str, dict[str, Any]] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)  # requests held for a wake, per model
    capacity: dict[str, Any] = field(default_factory=dict)  # the capacity manager's last look
    epoch: str | None = None  # the epoch of the log it follows (None: none yet, or older)
    log: str = "ok"  # its log as it sees it: ok, lost (being healed), unreachable

    def _doc(self) -> dict[str, Any]:
        return {**asdict(self), "figures": self.figures.doc()}

    def encode(self) -> str:
        return json.dumps(self._doc(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def decode(cls, raw: str | bytes) -> Report:
        try:
            doc = json.loads(raw)
            return cls(
                id=str(doc["id"]),
                version=str(doc["version"]),
                address=str(doc["address"]),
                applied=None if doc["applied"] is None else str(doc["applied"]),
                started_at=float(doc["started_at"]),
                reported_at=float(doc["reported_at"]),
                in_flight={str(k): int(v) for k, v in doc.get("in_flight", {}).items()},
                health={str(k): str(v) for k, v in doc.get("health", {}).items()},
                figures=Figures.parse(doc.get("figures")),  # none from an older replica
                driving={str(k): dict(v) for k, v in doc.get("driving", {}).items()},
                held={str(k): int(v) for k, v in doc.get("held", {}).items()},
                capacity=dict(doc.get("capacity", {})),
                epoch=None if doc.get("epoch") is None else str(doc["epoch"]),
                log=str(doc.get("log", "ok")),
            )
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise InvalidRequest(f"an unreadable replica report: {exc}") from None

    @property
    def position(self) -> Position | None:
        return None if self.applied is None else Position.parse(self.applied)

    def view(self, now: float) -> dict[str, Any]:
        """``GET /admin/replicas``' view of it."""
        return {
            **self._doc(),
            "figures": self.figures.view(),
            "uptime_s": round(max(0.0, now - self.started_at), 1),
        }


def lagging(reports: Sequence[Report], head: Position | None) -> list[str]:
    """The replicas that have not applied the log up to ``head``, by id."""
    if head is None:
        return []
    return sorted(r.id for r in reports if r.position is None or r.position < head)


def applied_by(
    standings: Iterable[tuple[str | None, str | None]], position: Position, epoch: str | None
) -> int:
    """How many replicas, each as (the position it applied, its epoch), applied ``position``
    of the log of ``epoch`` (a replica reporting no epoch: of a version before epochs)."""
    return sum(
        1
        for applied, their in standings
        if applied is not None and Position.parse(applied) >= position and their in (None, epoch)
    )


def log_problems(reports: Sequence[Report], epoch: str | None) -> dict[str, str]:
    """Replicas whose log is not the fleet's (``epoch``: the one in force), by id: what they
    say of it (``lost``, ``unreachable``) or ``other epoch``."""
    problems = {r.id: r.log for r in reports if r.log != "ok"}
    for r in reports:
        if r.id not in problems and epoch is not None and r.epoch not in (None, epoch):
            problems[r.id] = "other epoch"
    return dict(sorted(problems.items()))


def disagreements(reports: Sequence[Report]) -> dict[str, dict[str, str]]:
    """Backends whose health the replicas do not agree on: backend -> replica -> its view."""
    views: dict[str, dict[str, str]] = {}
    for r in reports:
        for backend, state in r.health.items():
            views.setdefault(backend, {})[r.id] = state
    return {
        backend: dict(sorted(seen.items()))
        for backend, seen in sorted(views.items())
        if len(set(seen.values())) > 1
    }


def in_flight(reports: Sequence[Report]) -> dict[str, int]:
    """Requests in flight per backend, summed over the replicas."""
    total: dict[str, int] = {}
    for r in reports:
        for backend, n in r.in_flight.items():
            total[backend] = total.get(backend, 0) + n
    return dict(sorted(total.items()))


class Registry(Protocol):
    async def report(self, report: Report) -> None:
        """Say that ``report.id`` is alive, as ``report`` says, for the registry's TTL."""
        ...

    async def leave(self, replica: str) -> None:
        """A replica that stops cleanly drops out at once, not after its TTL."""
        ...

    async def replicas(self) -> list[Report]:
        """Every replica whose last report has not expired, by id."""
        ...


def check_ttl(ttl: float) -> float:
    if ttl <= 0:
        raise ValueError("the registry's TTL must be positive")
    return ttl


class RedisRegistry:
    """One fleet's registry on Redis. ``redis`` is owned by the caller."""

    def __init__(self, redis: Redis, prefix: str, fleet: str, ttl: float) -> None:
        self.redis = redis
        self.ttl = check_ttl(ttl)
        self._base = f"{prefix}{fleet}:"
        self._ids = self._base + "replicas"

    def _key(self, replica: str) -> str:
        return f"{self._base}replica:{replica}"

    async def report(self, report: Report) -> None:
        """Say that ``report.id`` is alive, as ``report`` says, for the next ``ttl`` s."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self._key(report.id), report.encode(), px=int(self.ttl * 1000))
            pipe.sadd(self._ids, report.id)
            await pipe.execute()

    async def leave(self, replica: str) -> None:
        """A replica that stops cleanly drops out at once, not after its TTL."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(replica))
            pipe.srem(self._ids, replica)
            await pipe.execute()

    async def replicas(self) -> list[Report]:
        """Every replica whose last report has not expired, by id."""
        ids = sorted(i.decode() if isinstance(i, bytes) else str(i) for i in await self._members())
        if not ids:
            return []
        raws = await self.redis.mget([self._key(i) for i in ids])
        gone = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
        if gone:
            await self.redis.srem(self._ids, *gone)
        return [Report.decode(raw) for raw in raws if raw is not None]

    async def _members(self) -> Sequence[bytes | str]:
        members: Any = await self.redis.smembers(self._ids)
        return list(members)


def summary(
    reports: Sequence[Report], head: Position | None, epoch: str | None = None
) -> Mapping[str, Any]:
    """What the console and ``top`` show of the fleet: who lags, whose log is not the fleet's,
    who disagrees, the sums (in flight now; the figures of the replicas alive, each since it
    started)."""
    return {
        "replicas": len(reports),
        "head": None if head is None else str(head),
        "epoch": epoch,
        "log_problems": log_problems(reports, epoch),
        "lagging": lagging(reports, head),
        "disagree": disagreements(reports),
        "in_flight": in_flight(reports),
        "figures": total(r.figures for r in reports).view(),
    }
