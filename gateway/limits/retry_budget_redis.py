"""The retry budget of a fleet, on the Redis its replicas share
(``gateway.limits.retry_budget``): one budget for every replica's extra attempts.

Requests are counted here and added to Redis in batches (every ``flush_every`` s: nothing per
request reaches Redis), extra attempts are drawn one atomic call each (they are rare but for a
failing backend, when they are what the budget is for). Both land in one-second buckets keyed
by Redis's own clock (``TIME``), so replicas whose clocks differ count the same seconds. A batch
whose answer did not come may have landed all the same (Redis paused, or slow): it is sent again
as it was, under its id, and Redis adds a batch once whatever the number of times it is sent.

Redis out of reach (or slower than ``timeout``): this replica's own budget decides (its
requests, its extra attempts), said once per outage; the fleet's is used again once Redis
answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Final

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from backends.supervise import Supervisor
from gateway.config.declared import build
from gateway.config.settings import Settings
from gateway.limits.retry_budget import Kind, LocalBudget, RetryBudgetPolicy

log = structlog.get_logger("gateway.limits")

# ARGV: prefix, span (s), ratio, floor (extra attempts always allowed in the window), requests
# counted here and not yet added, ttl (s). 1 if one more extra attempt fits (and is counted).
_TAKE: Final = """
local now = tonumber(redis.call('TIME')[1])
local span = tonumber(ARGV[2])
local requests, extras = tonumber(ARGV[5]), 0
for s = now - span + 1, now do
  requests = requests + tonumber(redis.call('GET', ARGV[1] .. 'r:' .. s) or '0')
  extras = extras + tonumber(redis.call('GET', ARGV[1] .. 'x:' .. s) or '0')
end
if extras + 1 > tonumber(ARGV[3]) * requests + tonumber(ARGV[4]) then return 0 end
local key = ARGV[1] .. 'x:' .. now
redis.call('INCR', key)
redis.call('EXPIRE', key, ARGV[6])
return 1
"""

# ARGV: prefix, requests to add, ttl (s), the batch's id: added once, however often sent.
_ADD: Final = """
if not redis.call('SET', ARGV[1] .. 'b:' .. ARGV[4], 1, 'NX', 'EX', ARGV[3]) then return 0 end
local key = ARGV[1] .. 'r:' .. redis.call('TIME')[1]
redis.call('INCRBY', key, ARGV[2])
redis.call('EXPIRE', key, ARGV[3])
return 1
"""


class RedisBudget:
    def __init__(
        self,
        client: Redis,
        policy: RetryBudgetPolicy,
        *,
        key_prefix: str,
        clock: Callable[[], float],
        timeout: float = 0.1,
        flush_every: float = 0.5,
    ) -> None:
        self.policy = policy
        self._client = client
        self._prefix = key_prefix + "retry-budget:"
        self._timeout = timeout
        self._flush_every = flush_every
        self.local = LocalBudget(policy, clock)  # this replica's own: the fallback
        self._pending = 0  # requests counted here, not yet added to Redis
        # a batch sent, its answer not come (it may have landed): sent again as it was
        self._unanswered: tuple[str, int] | None = None
        self._span = max(1, math.ceil(policy.window))
        self._ttl = self._span + 5
        self._degraded = False
        self.taken: Counter[Kind] = Counter()
        self.refused: Counter[Kind] = Counter()
        self.degraded_decisions = 0  # extra attempts decided by this replica alone

    def deposit(self) -> None:
        self.local.deposit()
        self._pending += 1

    async def take(self, kind: Kind) -> bool:
        p = self.policy
        try:
            async with asyncio.timeout(self._timeout):
                fits = await self._client.eval(
                    _TAKE,
                    0,
                    self._prefix,
                    self._span,
                    p.ratio,
                    p.min_per_second * p.window,
                    self._pending,
                    self._ttl,
                )
        except (RedisError, OSError, TimeoutError) as exc:
            self._down(exc)
            self.degraded_decisions += 1
            fits = self.local.take_now(kind)
        else:
            self._up()
            if fits:
                self.local.take_now(kind)  # kept in step, for an outage to come
        (self.taken if fits else self.refused)[kind] += 1
        return bool(fits)

    async def run(self) -> None:
        """Add the requests counted here to Redis every ``flush_every`` s until cancelled
        (once more on the way out)."""
        try:
            while True:
                await asyncio.sleep(self._flush_every)  # sleep-ok: the flush period
                await self.flush()
        finally:
            with contextlib.suppress(Exception):
                await self.flush()

    async def flush(self) -> None:
        if self._unanswered is None:
            if not self._pending:
                return
            self._unanswered, self._pending = (uuid.uuid4().hex, self._pending), 0
        batch, n = self._unanswered
        try:
            async with asyncio.timeout(self._timeout * 5):
                await self._client.eval(_ADD, 0, self._prefix, n, self._ttl, batch)
        except (RedisError, OSError, TimeoutError) as exc:
            self._down(exc)
            return  # sent again at the next flush (their second may be a later one)
        self._unanswered = None
        self._up()

    def _down(self, exc: BaseException) -> None:
        if not self._degraded:
            self._degraded = True
            log.warning(
                "retry_budget_degraded",
                error=f"{type(exc).__name__}: {exc}",
                effect="each replica's own budget decides until Redis answers",
            )

    def _up(self) -> None:
        if self._degraded:
            self._degraded = False
            log.info("retry_budget_restored")

    @property
    def degraded(self) -> bool:
        return self._degraded


@contextlib.asynccontextmanager
async def open_retry_budget(
    s: Settings, supervisor: Supervisor
) -> AsyncIterator[LocalBudget | RedisBudget]:
    """The budget of extra attempts: the fleet's, on the limits' Redis when they share one
    (its requests added in batches, by a loop under ``supervisor``), else this replica's."""
    policy = build(RetryBudgetPolicy, s.retry, prefix="budget_")
    if s.limits.store != "redis":
        yield LocalBudget(policy, time.monotonic)
        return
    r = s.limits.redis
    client = Redis.from_url(
        r.url.get_secret_value(), socket_timeout=1.0, socket_connect_timeout=1.0, max_connections=4
    )
    budget = RedisBudget(
        client, policy, key_prefix=f"{r.key_prefix}{s.fleet.name}:", clock=time.monotonic
    )
    task = supervisor.spawn("retry_budget", "retry-budget", budget.run)
    try:
        yield budget
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.aclose()
