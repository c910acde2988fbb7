"""The limit store seam: one atomic admission per request, then settlement and release.

Algorithm: two token buckets per key (requests and tokens), refilled continuously at
``limit / 60`` per second up to ``limit``, plus a set of open concurrency slots.

- **Why buckets and not a sliding window.** A bucket is two numbers per limit and is updated in
  O(1), so the Redis side is one small hash per key; a reservation is returned by adding to the
  bucket, which a sliding log cannot do without finding the entry it was charged in. Its burst
  (a full minute's budget at once, after a quiet minute) matches what OpenAI's own limits allow.
- **Reserve, then settle.** ``admit`` takes the request's *estimated* tokens (prompt estimate +
  ``max_tokens``) out of the bucket in the same atomic step that checks it, so concurrent
  requests can never all see the same remaining budget. When the response ends, ``settle`` gives
  back what the estimate over-reserved, or takes the excess (the bucket may go into debt, which
  later requests then wait out).
- **Tickets.** Each admission carries a ``Ticket``; settling and releasing a ticket happen at most
  once each, however many times they are called, so a ``finally`` plus an error path cannot
  double-release a concurrency slot.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol

from gateway.limits.budget import Counted

Reason = Literal["requests", "tokens", "too_large", "concurrency"]


@dataclass(frozen=True, slots=True)
class Used:
    """What one request used, for its owner's usage by day and model."""

    day: str
    model: str
    tokens: int


_TICKET_PREFIX: Final = os.urandom(6).hex()
_ticket_counter = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits; ``None`` is unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    @property
    def unlimited(self) -> bool:
        return (
            self.requests_per_minute is None
            and self.tokens_per_minute is None
            and self.max_concurrent is None
        )


@dataclass(frozen=True, slots=True)
class LimitFigures:
    """One limit's figures after a decision, for the ``x-ratelimit-*`` headers."""

    limit: int
    remaining: int
    reset: float  # seconds until the bucket is full again


class Ticket:
    """One admission. Settles once and releases once; later calls are no-ops."""

    __slots__ = ("_released", "_settled", "accounted", "id", "key", "limits", "reserved")

    def __init__(self, key: str, limits: Limits, reserved: int, *, accounted: bool = True) -> None:
        self.id = f"{_TICKET_PREFIX}-{next(_ticket_counter)}"
        self.key = key
        self.limits = limits
        self.reserved = reserved
        # False when the store admitted without recording anything (unlimited key, or a
        # fail-open admission while the shared store was down): nothing to settle or release.
        self.accounted = accounted
        self._settled = not accounted
        self._released = not accounted

    def claim_settle(self) -> bool:
        """True the first time only: the caller then does the settling."""
        if self._settled:
            return False
        self._settled = True
        return True

    def claim_release(self) -> bool:
        if self._released:
            return False
        self._released = True
        return True

    @property
    def open(self) -> bool:
        return not (self._settled and self._released)

    def __repr__(self) -> str:
        return f"Ticket({self.id!r}, key={self.key!r}, reserved={self.reserved})"


@dataclass(frozen=True, slots=True)
class LimitDecision:
    allowed: bool
    ticket: Ticket | None = None
    reason: Reason | None = None
    retry_after: float = 0.0  # seconds, when refused
    requests: LimitFigures | None = None
    tokens: LimitFigures | None = None
    degraded: bool = False  # admitted without limits because the store was unavailable


class LimitStore(Protocol):
    """Where limit state lives: one process (memory) or shared by replicas (Redis)."""

    async def admit(self, key: str, limits: Limits, cost_tokens: int) -> LimitDecision:
        """Check and take one request, ``cost_tokens`` and a concurrency slot, atomically."""
        ...

    async def settle(self, ticket: Ticket, actual_tokens: int) -> None:
        """Correct the ticket's reservation to the real usage (once per ticket)."""
        ...

    async def release(self, ticket: Ticket) -> None:
        """Give back the ticket's concurrency slot (once per ticket)."""
        ...

    async def charge_budget(
        self, owner: str, cost: int, counts: Sequence[Counted]
    ) -> tuple[Counted, int] | None:
        """Take ``cost`` tokens from each of ``owner``'s ``counts`` unless that would take one
        past its limit: None when taken (from all), else the first that refused and what it
        has spent. Out of reach: the failure mode's (open: None, unchecked; closed:
        ``LimitsUnavailable``)."""
        ...

    async def settle_budget(
        self, owner: str, names: Sequence[str], delta: int, used: Used | None
    ) -> None:
        """Once a request's usage is known: give back ``delta`` tokens (negative: take more)
        to each of the counts it was charged to, and add ``used`` to the owner's usage by day
        and model. Out of reach: lost (the counts keep the reservation)."""
        ...

    async def budget_spent(self, owner: str, names: Sequence[str]) -> list[int] | None:
        """What ``owner`` spent in each named count; None when the store cannot say."""
        ...

    async def budget_usage(
        self, owner: str, days: Sequence[str]
    ) -> dict[str, dict[str, int]] | None:
        """``owner``'s tokens by day (of ``days``, those with any) and model; None when the
        store cannot say."""
        ...

    async def restore_counts(self) -> int:
        """After the store lost its data: write back the budgets' counts as last seen here
        (the largest of every replica's stays); how many were raised."""
        ...

    async def open(self) -> None:
        """Connect ahead of the first request (never raises: a store out of reach at start
        is its failure mode's business, as later)."""
        ...

    async def aclose(self) -> None: ...

    @property
    def available(self) -> bool:
        """False while the store cannot be reached (its failure mode applies meanwhile)."""
        ...


async def finish(store: LimitStore, ticket: Ticket, actual_tokens: int | None) -> None:
    """The end of a request: settle when the usage is known, then release the slot.

    Unknown usage (a stream cut before its usage chunk) keeps the whole reservation charged.
    """
    try:
        if actual_tokens is not None:
            await store.settle(ticket, actual_tokens)
    finally:
        await store.release(ticket)
