"""The data a routing policy sees: frozen snapshots of backends and the request's routing facts.

Nothing here does I/O or knows about aiohttp; the pool builds snapshots, a policy reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class BackendSnapshot:
    """A backend's load at one instant, as the gateway knows it.

    ``queue_depth``, ``running`` and ``kv_cache_usage`` are ``None`` when no scraped figure
    younger than the staleness bound exists: a policy then falls back to the local counts.
    ``sent_since_scrape`` counts requests the gateway sent after the last scrape began, which
    the scraped figures cannot include yet.
    """

    id: str
    in_flight: int
    sent_since_scrape: int = 0
    queue_depth: int | None = None
    running: int | None = None
    kv_cache_usage: float | None = None

    @property
    def scraped(self) -> bool:
        return self.queue_depth is not None


@dataclass(frozen=True, slots=True)
class RouteFacts:
    """What a policy may know about the request being routed."""

    model: str
    session_key: str | None = None
    prefix_hashes: tuple[int, ...] = field(default=())
    prefix_key: int | None = None  # the same in every gateway replica (``prefix.stable_key``)


class Policy(Protocol):
    """Chooses one of the candidates, or ``None`` if it will not choose any."""

    name: str

    def choose(
        self, facts: RouteFacts, candidates: list[BackendSnapshot]
    ) -> BackendSnapshot | None: ...


class Rng(Protocol):
    """The part of ``random.Random`` a policy uses, so tests can inject a seeded one."""

    def random(self) -> float: ...

    def randrange(self, stop: int, /) -> int: ...
