"""What the request path calls: authenticate, admit (reserve), finish (settle + release).

``Limiter`` holds the key table, the store and the reservation settings; a ``Grant`` is one
request's admission. The store is opened and closed by ``open_limiter`` (``gateway.root``).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final

from backends.errors import BudgetExceeded
from backends.supervise import Supervisor
from gateway.limits.budget import Budget, day_of, days_back, iso, resets_at
from gateway.limits.headers import rate_limit_headers, rate_limited
from gateway.limits.keys import Authenticator, Principal
from gateway.limits.memory import MemoryLimitStore
from gateway.limits.redis_store import RedisLimitStore
from gateway.limits.settings import LimitsSettings
from gateway.limits.store import LimitDecision, LimitStore, Ticket, Used, finish
from gateway.limits.tokens import Usage, reservation

_MODEL_CHARS: Final = 128


@dataclass(slots=True)
class Grant:
    """One admitted request: its reservation, and the headers to send with its response."""

    principal: Principal
    ticket: Ticket
    decision: LimitDecision
    reserved: int
    finished: bool = False
    charged: tuple[str, ...] = ()  # the budget counts this request was charged to
    model: str = ""  # as the request named it: its usage is kept by model

    @property
    def headers(self) -> dict[str, str]:
        """``x-ratelimit-*`` for the response (as OpenAI sends them on every answer)."""
        return rate_limit_headers(self.decision)


class Limiter:
    def __init__(
        self, settings: LimitsSettings, store: LimitStore, clock: Callable[[], float] = time.time
    ) -> None:
        """``clock``: Unix time (budgets' days and months, keys' expiry)."""
        self.settings = settings
        self.store = store
        self.clock = clock
        self.auth = Authenticator(settings, clock)
        self.rejections: Counter[tuple[str, str]] = Counter()  # (principal id, reason)
        # Admitted unchecked (the shared store was down, failure_mode open), by principal id.
        self.degraded_admissions: Counter[str] = Counter()

    def authenticate(self, headers: Mapping[str, str]) -> Principal:
        return self.auth.authenticate(headers)

    def reservation(self, doc: dict[str, Any], generates: bool = True) -> int:
        return reservation(
            doc,
            default_max_tokens=self.settings.default_max_tokens,
            chars_per_token=self.settings.chars_per_token,
            generates=generates,
        )

    async def admit(
        self, principal: Principal, doc: dict[str, Any], *, generates: bool = True
    ) -> Grant:
        """Reserve the request's estimated tokens; ``RateLimited`` (429) when over a limit.

        ``generates``: whether the endpoint generates (and so reserves a completion budget).
        ``LimitsUnavailable`` (503) when a fail-closed shared store cannot be reached.
        """
        cost = self.reservation(doc, generates)
        decision = await self.store.admit(principal.id, principal.limits, cost)
        if not decision.allowed:
            self.rejections[(principal.id, decision.reason or "unknown")] += 1
            raise rate_limited(decision, key_name=principal.id, requested_tokens=cost)
        if decision.degraded:
            self.degraded_admissions[principal.id] += 1
        assert decision.ticket is not None
        grant = Grant(principal, decision.ticket, decision, cost)
        if principal.budget is not None:
            model = doc.get("model")
            grant.model = model[:_MODEL_CHARS] if isinstance(model, str) else ""
            await self._charge(grant, principal.budget)
        return grant

    async def _charge(self, grant: Grant, budget: Budget) -> None:
        """Take the request's reservation from its caller's budget (each period's count), or
        refuse it (and give back what the rate limits reserved): the reservation is taken
        before the request runs, so requests at once through any replica cannot all see the
        same budget left."""
        now = self.clock()
        counts = budget.counted(now)
        owner = grant.principal.id
        try:
            refused = await self.store.charge_budget(owner, grant.reserved, counts)
        except BaseException:
            await self.finish(grant, 0)
            raise
        if refused is None:
            grant.charged = tuple(c.name for c in counts)
            return
        await self.finish(grant, 0)
        self.rejections[(owner, "budget")] += 1
        count, spent = refused
        resets = resets_at(count.period, now)
        raise BudgetExceeded(
            f"`{owner}` has used {spent} of its {count.limit} tokens for this "
            f"{count.period} (UTC); this request would take up to {grant.reserved} more. "
            f"The budget resets at {iso(resets)}. Ask for a larger budget, or lower "
            "max_tokens.",
            headers={"Retry-After": str(max(1, math.ceil(resets - now)))},
        )

    async def finish(self, grant: Grant, usage: Usage | int | None) -> None:
        """Settle against the real usage (``None``: keep the reservation), release the slot.

        Idempotent; call it in the request's one ``finally``. A request that never reached a
        backend should pass ``0``, so its tokens are given back.
        """
        if grant.finished:
            return
        grant.finished = True
        actual = usage.total_tokens if isinstance(usage, Usage) else usage
        try:
            await finish(self.store, grant.ticket, actual)
        finally:
            if grant.charged:
                used = grant.reserved if actual is None else actual
                await self.store.settle_budget(
                    grant.principal.id,
                    grant.charged,
                    grant.reserved - used,
                    Used(day_of(self.clock()), grant.model, used) if used > 0 else None,
                )

    async def usage(self, name: str, days: int) -> dict[str, Any]:
        """``GET /admin/keys/{name}/usage``: the key's budget, what it spent in each period
        and when that resets, and its tokens by day (the last ``days``) and model."""
        budget = self.auth.budget(name)  # NotFound if no such key
        owner, now = f"key:{name}", self.clock()
        by_day = await self.store.budget_usage(owner, days_back(now, days))
        return {
            "name": name,
            "budget": await self.budget_view(name, budget),
            "days": None
            if by_day is None
            else [
                {"day": day, "tokens": sum(models.values()), "models": models}
                for day, models in by_day.items()
            ],
        }

    async def budget_view(self, name: str, budget: Budget | None) -> dict[str, Any] | None:
        """A key's budget as the admin API shows it: each period's limit, spent, reset."""
        if budget is None:
            return None
        now = self.clock()
        counts = budget.counted(now)
        spent = await self.store.budget_spent(f"key:{name}", [c.name for c in counts])
        return {
            "source": budget.source,
            **budget.to_json(),
            "periods": {
                c.period: {
                    "limit": c.limit,
                    "spent": None if spent is None else spent[i],
                    "resets_at": iso(resets_at(c.period, now)),
                }
                for i, c in enumerate(counts)
            },
        }


def make_store(
    settings: LimitsSettings, *, retry_after: int = 1, supervisor: Supervisor | None = None
) -> LimitStore:
    if settings.store == "redis":
        return RedisLimitStore.from_settings(
            settings.redis, retry_after=retry_after, supervisor=supervisor
        )
    return MemoryLimitStore()


@asynccontextmanager
async def open_limiter(
    settings: LimitsSettings, *, retry_after: int = 1, supervisor: Supervisor | None = None
) -> AsyncIterator[Limiter]:
    """A limiter and its store, closed on exit (one step of ``gateway.root``)."""
    store = make_store(settings, retry_after=retry_after, supervisor=supervisor)
    await store.open()
    try:
        yield Limiter(settings, store)
    finally:
        await store.aclose()
