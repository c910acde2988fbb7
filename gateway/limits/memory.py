"""The in-memory limit store: one process, the default. No awaits inside, so each call is atomic
on the event loop; the clock is injected."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from gateway.limits import bucket
from gateway.limits.store import Decision, Limits, Ticket


class MemoryLimitStore:
    available = True  # in this process: never out of reach

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, tuple[bucket.Buckets, Limits]] = {}
        self._slots: dict[str, set[str]] = {}
        self._spent: dict[str, int] = {}  # budget counter -> tokens

    def admit_now(self, key: str, limits: Limits, cost_tokens: int) -> Decision:
        """``admit`` without the coroutine, for callers (and tests) that are not async."""
        if limits.unlimited:
            return Decision(allowed=True, ticket=Ticket(key, limits, cost_tokens, accounted=False))
        now = self._clock()
        self._forget_full(now)
        held = self._buckets.get(key)
        slots = self._slots.get(key)
        decision, after = bucket.admit(
            held[0] if held else None, limits, cost_tokens, now, len(slots) if slots else 0
        )
        if not decision.allowed:
            return decision
        assert after is not None
        self._buckets[key] = (after, limits)
        ticket = Ticket(key, limits, cost_tokens)
        if limits.max_concurrent is not None:
            self._slots.setdefault(key, set()).add(ticket.id)
        return replace(decision, ticket=ticket)

    def settle_now(self, ticket: Ticket, actual_tokens: int) -> None:
        if not ticket.claim_settle():
            return
        delta = ticket.reserved - actual_tokens
        if delta == 0 or ticket.limits.tokens_per_minute is None:
            return
        held = self._buckets.get(ticket.key)
        state = held[0] if held is not None else None  # forgotten: it was full
        limits = ticket.limits
        self._buckets[ticket.key] = (bucket.settle(state, limits, delta, self._clock()), limits)

    def release_now(self, ticket: Ticket) -> None:
        if not ticket.claim_release():
            return
        slots = self._slots.get(ticket.key)
        if slots is not None:
            slots.discard(ticket.id)
            if not slots:
                del self._slots[ticket.key]

    async def admit(self, key: str, limits: Limits, cost_tokens: int) -> Decision:
        return self.admit_now(key, limits, cost_tokens)

    async def settle(self, ticket: Ticket, actual_tokens: int) -> None:
        self.settle_now(ticket, actual_tokens)

    async def release(self, ticket: Ticket) -> None:
        self.release_now(ticket)

    async def charge_budget(self, counter: str, cost: int, budget: int) -> int | None:
        spent = self._spent.get(counter, 0)
        if spent + cost > budget:
            return spent
        self._spent[counter] = spent + cost
        return None

    async def refund_budget(self, counter: str, delta: int) -> None:
        self._spent[counter] = max(0, self._spent.get(counter, 0) - delta)

    async def budget_spent(self, counter: str) -> int | None:
        return self._spent.get(counter, 0)

    async def open(self) -> None:
        pass  # nothing to connect to

    async def aclose(self) -> None:
        self._buckets.clear()
        self._slots.clear()

    def slots_in_use(self, key: str) -> int:
        return len(self._slots.get(key, ()))

    def tracked_keys(self) -> int:
        return len(self._buckets)

    def _forget_full(self, now: float) -> None:
        # Amortised: look at one bucket per call, so memory stays bounded by the keys in use
        # without a background task.
        if not self._buckets:
            return
        key = next(iter(self._buckets))
        state, limits = self._buckets.pop(key)
        if bucket.seconds_to_full(bucket.refill(state, limits, now), limits) > 0:
            self._buckets[key] = (state, limits)  # still needed: back of the line
