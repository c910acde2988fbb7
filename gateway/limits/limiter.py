"""What the request path calls: authenticate, admit (reserve), finish (settle + release).

``Limiter`` holds the key table, the store and the reservation settings; a ``Grant`` is one
request's admission. The store is owned by the app's cleanup context (``open_store``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from backends.errors import BudgetExhausted
from backends.supervise import Supervisor
from gateway.limits.headers import rate_limit_headers, rate_limited
from gateway.limits.keys import Authenticator, Budget, Principal
from gateway.limits.memory import MemoryLimitStore
from gateway.limits.redis_store import RedisLimitStore
from gateway.limits.settings import LimitsSettings
from gateway.limits.store import Decision, LimitStore, Ticket, finish
from gateway.limits.tokens import Usage, reservation


@dataclass(slots=True)
class Grant:
    """One admitted request: its reservation, and the headers to send with its response."""

    principal: Principal
    ticket: Ticket
    decision: Decision
    reserved: int
    finished: bool = False
    budget: Budget | None = None  # the key's budget this request was charged to

    @property
    def headers(self) -> dict[str, str]:
        """``x-ratelimit-*`` for the response (as OpenAI sends them on every answer)."""
        return rate_limit_headers(self.decision)


class Limiter:
    def __init__(self, settings: LimitsSettings, store: LimitStore) -> None:
        self.settings = settings
        self.store = store
        self.auth = Authenticator(settings)
        self.rejections: Counter[tuple[str, str]] = Counter()  # (principal id, reason)
        self.degraded_admissions = 0  # admitted unchecked: the shared store was down

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
            self.degraded_admissions += 1
        assert decision.ticket is not None
        grant = Grant(principal, decision.ticket, decision, cost)
        if principal.budget is not None:
            await self._charge(grant, principal.budget)
        return grant

    async def _charge(self, grant: Grant, budget: Budget) -> None:
        """Take the request's reservation from its key's budget, or refuse it (and give back
        what the rate limits reserved): the reservation is taken before the request runs, so
        requests at once through any replica cannot all see the same budget left."""
        try:
            spent = await self.store.charge_budget(budget.counter, grant.reserved, budget.tokens)
        except BaseException:
            await self.finish(grant, 0)
            raise
        if spent is None:
            grant.budget = budget
            return
        await self.finish(grant, 0)
        self.rejections[(grant.principal.id, "budget")] += 1
        raise BudgetExhausted(
            f"`{grant.principal.id}` has used {spent} of its {budget.tokens}-token budget; "
            f"this request would take up to {grant.reserved} more. Ask for a larger budget, "
            "or lower max_tokens."
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
            if grant.budget is not None and actual is not None and actual != grant.reserved:
                await self.store.refund_budget(grant.budget.counter, grant.reserved - actual)


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
    """A limiter and its store, closed on exit: for the app's cleanup context."""
    store = make_store(settings, retry_after=retry_after, supervisor=supervisor)
    await store.open()
    try:
        yield Limiter(settings, store)
    finally:
        await store.aclose()
