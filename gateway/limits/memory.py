"""The in-memory limit store: one process, the default. No awaits inside, so each call is atomic
on the event loop; the clock is injected."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Final

from gateway.limits.bucket import Buckets, refill, seconds_to_full
from gateway.limits.bucket import admit as admit_buckets
from gateway.limits.bucket import settle as settle_buckets
from gateway.limits.budget import Counted
from gateway.limits.store import LimitDecision, Limits, Ticket, Used

# Bounds on what budgets keep per owner (owners are keys: the operator's, not the clients'):
_COUNTS_KEPT: Final = 4  # this and the last period of each kind
_DAYS_KEPT: Final = 93  # usage by day, a quarter's worth
_MODELS_KEPT: Final = 64  # models a day, the rest as "other"


class MemoryLimitStore:
    available = True  # in this process: never out of reach

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, tuple[Buckets, Limits]] = {}
        self._slots: dict[str, set[str]] = {}
        # budgets: owner -> count name -> tokens; owner -> day -> model -> tokens
        self._spent: dict[str, OrderedDict[str, int]] = {}
        self._usage: dict[str, OrderedDict[str, dict[str, int]]] = {}

    def admit_now(self, key: str, limits: Limits, cost_tokens: int) -> LimitDecision:
        """``admit`` without the coroutine, for callers (and tests) that are not async."""
        if limits.unlimited:
            return LimitDecision(
                allowed=True, ticket=Ticket(key, limits, cost_tokens, accounted=False)
            )
        now = self._clock()
        self._forget_full(now)
        held = self._buckets.get(key)
        slots = self._slots.get(key)
        decision, after = admit_buckets(
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
        self._buckets[ticket.key] = (settle_buckets(state, limits, delta, self._clock()), limits)

    def release_now(self, ticket: Ticket) -> None:
        if not ticket.claim_release():
            return
        slots = self._slots.get(ticket.key)
        if slots is not None:
            slots.discard(ticket.id)
            if not slots:
                del self._slots[ticket.key]

    async def admit(self, key: str, limits: Limits, cost_tokens: int) -> LimitDecision:
        return self.admit_now(key, limits, cost_tokens)

    async def settle(self, ticket: Ticket, actual_tokens: int) -> None:
        self.settle_now(ticket, actual_tokens)

    async def release(self, ticket: Ticket) -> None:
        self.release_now(ticket)

    async def charge_budget(
        self, owner: str, cost: int, counts: Sequence[Counted]
    ) -> tuple[Counted, int] | None:
        spent = self._spent.setdefault(owner, OrderedDict())
        for c in counts:
            if spent.get(c.name, 0) + cost > c.limit:
                return c, spent.get(c.name, 0)
        for c in counts:
            spent[c.name] = spent.get(c.name, 0) + cost
            spent.move_to_end(c.name)
        while len(spent) > _COUNTS_KEPT:  # past periods
            spent.popitem(last=False)
        return None

    async def settle_budget(
        self, owner: str, names: Sequence[str], delta: int, used: Used | None
    ) -> None:
        spent = self._spent.get(owner)
        if spent is not None:
            for name in names:
                if name in spent:
                    spent[name] = max(0, spent[name] - delta)
        if used is None or used.tokens <= 0:
            return
        days = self._usage.setdefault(owner, OrderedDict())
        models = days.setdefault(used.day, {})
        days.move_to_end(used.day)
        while len(days) > _DAYS_KEPT:
            days.popitem(last=False)
        model = used.model if used.model in models or len(models) < _MODELS_KEPT else "other"
        models[model] = models.get(model, 0) + used.tokens

    async def budget_spent(self, owner: str, names: Sequence[str]) -> list[int] | None:
        spent = self._spent.get(owner)
        return [0 if spent is None else spent.get(name, 0) for name in names]

    async def budget_usage(
        self, owner: str, days: Sequence[str]
    ) -> dict[str, dict[str, int]] | None:
        held = self._usage.get(owner)
        if held is None:
            return {}
        return {day: dict(held[day]) for day in days if day in held}

    async def restore_counts(self) -> int:
        """Nothing to restore: this process's counts are lost only with it."""
        return 0

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
        if seconds_to_full(refill(state, limits, now), limits) > 0:
            self._buckets[key] = (state, limits)  # still needed: back of the line
