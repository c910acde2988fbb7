"""The Redis limit store: limits shared by any number of gateway replicas.

One admission is one ``EVALSHA`` of ``ADMIT_LUA`` (``EVAL`` once after a Redis restart flushed
the script cache): the check and the update happen inside Redis, so two replicas can never both
take the last unit of a budget. The script reads Redis's own clock (``TIME``), the only clock
all replicas share. Per key there are two Redis keys, hash-tagged so a cluster keeps them on one
slot: ``<prefix>{<key>}:b`` (the two bucket levels, expiring once the buckets would be full
again) and ``<prefix>{<key>}:c`` (a sorted set of concurrency slots, one member per ticket,
scored by its expiry, so slots of a crashed gateway come back after ``slot_ttl``).

Redis slow or down: every call is bounded by ``timeout``; then ``failure_mode`` decides (open:
admit without limits, logged once per outage; closed: ``LimitsUnavailable``, a 503). After a
failure Redis is not tried again for ``retry_interval``, so an outage costs requests no waiting;
the first success after it ends the outage, with no restart.

The budgets' counts outlive a Redis restarted empty (or its data lost another way): the store
keeps the last value it saw of each count (every charge, settlement and read answers it), and
when the fleet finds its log lost (``gateway.fleet.epoch``), every replica writes back what it
saw (``restore_counts``), each count taking the largest: what was spent before the loss is
still counted (a little more, never less: a settlement seen by no replica is counted as the
reservation it gave back).

What a request owes Redis when it ends (its concurrency slot, its token correction) is not lost
to a blip: a release or settlement that cannot reach Redis waits in a bounded backlog
(``max_backlog`` tickets, oldest dropped first: their slots still expire after ``slot_ttl``),
which a background task retries every ``retry_interval`` until Redis answers again.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final

import structlog
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from backends.errors import LimitsUnavailable
from backends.supervise import Supervisor
from gateway.limits.budget import Counted
from gateway.limits.settings import RedisSettings
from gateway.limits.store import LimitDecision, LimitFigures, Limits, Reason, Ticket, Used

log = structlog.get_logger("gateway.limits")

# Mirrors gateway.limits.bucket.admit; 0 stands for "unlimited".
ADMIT_LUA: Final = """
local rpm, tpm, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost, slot_ttl = tonumber(ARGV[4]), tonumber(ARGV[6])
local tm = redis.call('TIME')
local now = tonumber(tm[1]) + tonumber(tm[2]) / 1000000
local st = redis.call('HMGET', KEYS[1], 'r', 't', 'at')
local r, t, at = tonumber(st[1]) or rpm, tonumber(st[2]) or tpm, tonumber(st[3]) or now
local dt = math.max(0, now - at)
if rpm > 0 then r = math.min(rpm, r + dt * rpm / 60) end
if tpm > 0 then t = math.min(tpm, t + dt * tpm / 60) end
now = math.max(now, at)
local reason, retry, held = 0, 0, 0
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  held = redis.call('ZCARD', KEYS[2])
end
if maxc > 0 and held >= maxc then reason, retry = 4, 1
elseif rpm > 0 and r < 1 then reason, retry = 1, (1 - r) * 60 / rpm
elseif tpm > 0 and cost > tpm then reason = 3
elseif tpm > 0 and t < cost then reason, retry = 2, (cost - t) * 60 / tpm
end
if reason == 0 then
  if rpm > 0 then r = r - 1 end
  if tpm > 0 then t = t - cost end
  local full = 0
  if rpm > 0 then full = math.max(full, (rpm - r) * 60 / rpm) end
  if tpm > 0 then full = math.max(full, (tpm - t) * 60 / tpm) end
  if full > 0 then
    redis.call('HSET', KEYS[1], 'r', tostring(r), 't', tostring(t), 'at', tostring(now))
    redis.call('PEXPIRE', KEYS[1], math.ceil(full * 1000) + 1000)
  elseif rpm > 0 or tpm > 0 then
    redis.call('DEL', KEYS[1])
  end
  if maxc > 0 then
    redis.call('ZADD', KEYS[2], now + slot_ttl, ARGV[5])
    redis.call('PEXPIRE', KEYS[2], math.ceil(slot_ttl * 1000) + 1000)
  end
end
local r_reset, t_reset = 0, 0
if rpm > 0 then r_reset = math.ceil((rpm - r) * 60000 / rpm) end
if tpm > 0 then t_reset = math.ceil((tpm - t) * 60000 / tpm) end
return {reason, math.floor(r), math.floor(t), math.ceil(retry * 1000), r_reset, t_reset}
"""

# Mirrors gateway.limits.bucket.settle: give back (or take) delta tokens, debt bounded.
SETTLE_LUA: Final = """
local rpm, tpm, delta = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tm = redis.call('TIME')
local now = tonumber(tm[1]) + tonumber(tm[2]) / 1000000
local st = redis.call('HMGET', KEYS[1], 'r', 't', 'at')
local r, t, at = tonumber(st[1]) or rpm, tonumber(st[2]) or tpm, tonumber(st[3]) or now
local dt = math.max(0, now - at)
if rpm > 0 then r = math.min(rpm, r + dt * rpm / 60) end
t = math.min(tpm, math.max(-tpm, math.min(tpm, t + dt * tpm / 60) + delta))
now = math.max(now, at)
local full = (tpm - t) * 60 / tpm
if rpm > 0 then full = math.max(full, (rpm - r) * 60 / rpm) end
if full > 0 then
  redis.call('HSET', KEYS[1], 'r', tostring(r), 't', tostring(t), 'at', tostring(now))
  redis.call('PEXPIRE', KEYS[1], math.ceil(full * 1000) + 1000)
else
  redis.call('DEL', KEYS[1])
end
return 1
"""

_REASONS: Final[dict[int, Reason]] = {1: "requests", 2: "tokens", 3: "too_large", 4: "concurrency"}
_FAILURES: Final = (RedisError, OSError, TimeoutError)

_CLOSE_WAIT_S: Final = 2.0  # per step of aclose
_OPEN_WAIT_S: Final = 5.0  # for the connections opened at start
# Connecting may take longer than a call: a request's own ``timeout`` still bounds its wait.
_CONNECT_TIMEOUT_S: Final = 1.0


# KEYS: the owner's counts. ARGV: cost, TTL (ms), then each count's limit. {0, 0, each count
# after the charge} when taken from every count, else {the 1-based index of the first that
# refused, what it has spent}.
BUDGET_LUA: Final = """
local cost = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  local spent = tonumber(redis.call('GET', key) or '0')
  if spent + cost > tonumber(ARGV[i + 2]) then return {i, spent} end
end
local after = {0, 0}
for i, key in ipairs(KEYS) do
  after[i + 2] = redis.call('INCRBY', key, cost)
  redis.call('PEXPIRE', key, ARGV[2])
end
return after
"""
# KEYS: one count. ARGV: a value seen of it, its TTL (ms). Sets it if it holds less (or
# nothing): of several replicas writing back what each saw, the largest stays.
BUDGET_AT_LEAST_LUA: Final = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
if cur >= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# KEYS: the counts charged, then the usage hash of the day (or nothing). ARGV: delta, then
# (with a usage hash) the model, its tokens and the hash's TTL (ms).
BUDGET_SETTLE_LUA: Final = """
local n = #KEYS
if #ARGV > 1 then n = n - 1 end
local after = {}
for i = 1, n do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    after[i] = redis.call('DECRBY', KEYS[i], ARGV[1])
  else
    after[i] = -1
  end
end
if #ARGV > 1 then
  redis.call('HINCRBY', KEYS[#KEYS], ARGV[2], ARGV[3])
  redis.call('PEXPIRE', KEYS[#KEYS], ARGV[4])
end
return after
"""
_COUNT_TTL_MS: Final = 62 * 86_400_000  # a count outlives its period (a month)
_USAGE_TTL_MS: Final = 400 * 86_400_000  # usage by day: a year and some
_MODEL_CHARS: Final = 128  # a model's name as usage keeps it
_SEEN_COUNTS: Final = 10_000  # counts whose last value is kept, for a Redis that lost them


def _text(raw: bytes | str) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


class _InRetryWindow(ConnectionError):
    """Redis failed moments ago; it is not tried again until the retry interval has passed."""


class _Script:
    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


_ADMIT: Final = _Script(ADMIT_LUA)
_SETTLE: Final = _Script(SETTLE_LUA)
_BUDGET: Final = _Script(BUDGET_LUA)
_BUDGET_SETTLE: Final = _Script(BUDGET_SETTLE_LUA)
_BUDGET_AT_LEAST: Final = _Script(BUDGET_AT_LEAST_LUA)


class _Owed:
    """What one ticket still owes Redis: its slot's release and/or a token correction."""

    __slots__ = ("release", "settle")

    def __init__(self) -> None:
        self.release: Ticket | None = None
        self.settle: tuple[Ticket, int] | None = None  # the ticket and its delta


class RedisLimitStore:
    def __init__(
        self,
        client: Redis,
        *,
        key_prefix: str = "llm-gateway:limits:",
        timeout: float = 0.05,
        failure_mode: str = "open",
        retry_interval: float = 0.5,
        slot_ttl: float = 900.0,
        retry_after: int = 1,
        max_backlog: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        supervisor: Supervisor | None = None,
    ) -> None:
        if failure_mode not in ("open", "closed"):
            raise ValueError(f"failure_mode must be 'open' or 'closed', not {failure_mode!r}")
        self._client = client
        self._prefix = key_prefix
        self._timeout = timeout
        self.fail_open = failure_mode == "open"
        self._retry_interval = retry_interval
        self._slot_ttl = slot_ttl
        self._retry_after = retry_after
        self._clock = clock
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._max_backlog = max_backlog
        self._backlog: OrderedDict[str, _Owed] = OrderedDict()  # by ticket id, oldest first
        self._flusher: asyncio.Task[None] | None = None
        self._supervisor = supervisor or Supervisor()
        self.backlog_dropped = 0  # owed operations given up (backlog full): slots expire
        self._seen: OrderedDict[str, int] = OrderedDict()  # count key -> its last value seen

    @classmethod
    def from_settings(
        cls, s: RedisSettings, *, retry_after: int = 1, supervisor: Supervisor | None = None
    ) -> RedisLimitStore:
        # A capped pool: a burst shares the connections opened at start (``open``) instead of
        # opening one each, which on a busy host outlasts ``timeout`` and fails the burst open.
        pool = BlockingConnectionPool.from_url(
            s.url.get_secret_value(),
            max_connections=s.max_connections,
            timeout=None,  # waiting for a free connection counts against our own timeout
            socket_timeout=s.timeout,
            socket_connect_timeout=max(s.timeout, _CONNECT_TIMEOUT_S),
            retry=Retry(NoBackoff(), 0),  # our own timeout and failure mode decide, not retries
        )
        client = Redis.from_pool(pool)
        return cls(
            client,
            key_prefix=s.key_prefix,
            timeout=s.timeout,
            failure_mode=s.failure_mode,
            retry_interval=s.retry_interval,
            slot_ttl=s.slot_ttl,
            retry_after=retry_after,
            max_backlog=s.max_backlog,
            supervisor=supervisor,
        )

    async def open(self, *, within: float = _OPEN_WAIT_S) -> None:
        """Open the pool's connections and load the scripts, before the first request: a
        first burst then neither connects nor meets NOSCRIPT within its ``timeout``. Redis
        out of reach: logged, and the failure mode applies to requests as at any time."""
        size = getattr(self._client.connection_pool, "max_connections", 1)
        started = self._clock()
        try:
            async with asyncio.timeout(within):
                pings = await asyncio.gather(
                    *(self._client.ping() for _ in range(size)), return_exceptions=True
                )
                failed = [p for p in pings if isinstance(p, BaseException)]
                if len(failed) == size:
                    raise failed[0]
                for script in (_ADMIT, _SETTLE):
                    await self._client.script_load(script.source)
        except _FAILURES as exc:
            log.warning(
                "limits_store_unavailable_at_start",
                error=f"{type(exc).__name__}: {exc}",
                failure_mode="open" if self.fail_open else "closed",
            )
            return
        log.info(
            "limits_store_connected",
            connections=size - len(failed),
            took_ms=round((self._clock() - started) * 1000, 1),
        )

    @property
    def available(self) -> bool:
        """False during an outage (from the first failure until the next success)."""
        return self._down_since is None

    def redis_keys(self, key: str) -> tuple[str, str]:
        base = f"{self._prefix}{{{key}}}"
        return f"{base}:b", f"{base}:c"

    async def admit(self, key: str, limits: Limits, cost_tokens: int) -> LimitDecision:
        if limits.unlimited:
            return LimitDecision(
                allowed=True, ticket=Ticket(key, limits, cost_tokens, accounted=False)
            )
        ticket = Ticket(key, limits, cost_tokens)
        args = (
            limits.requests_per_minute or 0,
            limits.tokens_per_minute or 0,
            limits.max_concurrent or 0,
            cost_tokens,
            ticket.id,
            self._slot_ttl,
        )
        try:
            res = await self._script(_ADMIT, self.redis_keys(key), args)
        except _FAILURES as exc:
            return self._unavailable(ticket, exc)
        except asyncio.CancelledError:
            # The client went away while the script was on its way: Redis may run it all the
            # same, and then holds a slot that nobody would give back before its TTL.
            if limits.max_concurrent is not None:
                self._owe(ticket).release = ticket
            raise
        reason_code, r_left, t_left, retry_ms, r_reset, t_reset = (int(x) for x in res)
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        requests = None if rpm is None else LimitFigures(rpm, max(0, r_left), r_reset / 1000)
        tokens = None if tpm is None else LimitFigures(tpm, max(0, t_left), t_reset / 1000)
        if reason_code:
            return LimitDecision(
                allowed=False,
                reason=_REASONS[reason_code],
                retry_after=retry_ms / 1000,
                requests=requests,
                tokens=tokens,
            )
        return LimitDecision(allowed=True, ticket=ticket, requests=requests, tokens=tokens)

    def budget_key(self, owner: str, name: str) -> str:
        """One of ``owner``'s counts (``day:...``, ``month:...``, ``usage:<day>``); an owner's
        keys share a hash slot (one script touches several)."""
        return f"{self._prefix}{{budget:{owner}}}:{name}"

    async def charge_budget(
        self, owner: str, cost: int, counts: Sequence[Counted]
    ) -> tuple[Counted, int] | None:
        keys = [self.budget_key(owner, c.name) for c in counts]
        args = (cost, _COUNT_TTL_MS, *(c.limit for c in counts))
        try:
            index, spent, *after = await self._script(_BUDGET, keys, args)
        except _FAILURES as exc:
            self._note_failure(exc)
            if not self.fail_open:
                raise LimitsUnavailable(
                    "Token budgets cannot be checked right now; please retry shortly.",
                    retry_after=self._retry_after,
                ) from exc
            return None
        if int(index) != 0:
            self._saw(keys[int(index) - 1], int(spent))
            return counts[int(index) - 1], int(spent)
        for key, value in zip(keys, after, strict=False):
            self._saw(key, int(value))
        return None

    async def settle_budget(
        self, owner: str, names: Sequence[str], delta: int, used: Used | None
    ) -> None:
        keys = [self.budget_key(owner, n) for n in names]
        args: list[Any] = [delta]
        if used is not None and used.tokens > 0:
            keys.append(self.budget_key(owner, f"usage:{used.day}"))
            args += [used.model[:_MODEL_CHARS], used.tokens, _USAGE_TTL_MS]
        if (delta == 0 and len(args) == 1) or not keys:
            return
        try:
            after = await self._script(_BUDGET_SETTLE, keys, args)
        except _FAILURES as exc:  # lost: the counts keep the reservation (never under-count)
            self._note_failure(exc)
            return
        for key, value in zip(keys, after, strict=False):
            if int(value) >= 0:
                self._saw(key, int(value))

    async def budget_spent(self, owner: str, names: Sequence[str]) -> list[int] | None:
        if not names:
            return []
        try:
            raws = await self._bounded(
                self._client.mget([self.budget_key(owner, n) for n in names])
            )
        except _FAILURES as exc:
            self._note_failure(exc)
            return None
        for name, raw in zip(names, raws, strict=True):
            if raw is not None:
                self._saw(self.budget_key(owner, name), int(raw))
        return [int(raw or 0) for raw in raws]

    def _saw(self, key: str, value: int) -> None:
        self._seen[key] = value
        self._seen.move_to_end(key)
        while len(self._seen) > _SEEN_COUNTS:
            self._seen.popitem(last=False)

    async def restore_counts(self) -> int:
        """Write back every count's last value seen here where Redis holds less (it lost
        them); how many were raised. Failures: logged, the counts stay as Redis has them."""
        raised = 0
        try:
            for key, value in list(self._seen.items()):
                raised += int(await self._script(_BUDGET_AT_LEAST, [key], (value, _COUNT_TTL_MS)))
        except _FAILURES as exc:
            self._note_failure(exc)
            log.warning("budget_counts_not_restored", error=str(exc) or type(exc).__name__)
            return raised
        log.warning("budget_counts_restored", raised=raised, known=len(self._seen))
        return raised

    async def budget_usage(
        self, owner: str, days: Sequence[str]
    ) -> dict[str, dict[str, int]] | None:
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for day in days:
                    pipe.hgetall(self.budget_key(owner, f"usage:{day}"))
                held = await self._bounded(pipe.execute())
        except _FAILURES as exc:
            self._note_failure(exc)
            return None
        return {
            day: {_text(m): int(t) for m, t in models.items()}
            for day, models in zip(days, held, strict=True)
            if models
        }

    async def settle(self, ticket: Ticket, actual_tokens: int) -> None:
        if not ticket.claim_settle():
            return
        delta = ticket.reserved - actual_tokens
        if delta == 0 or ticket.limits.tokens_per_minute is None:
            return
        try:
            await self._settle(ticket, delta)
        except _FAILURES as exc:
            self._note_failure(exc)
            self._owe(ticket).settle = (ticket, delta)

    async def release(self, ticket: Ticket) -> None:
        if not ticket.claim_release() or ticket.limits.max_concurrent is None:
            return
        owed = self._backlog.get(ticket.id)
        if owed is not None and owed.settle is not None:  # keep its order: settle, release
            owed.release = ticket
            return
        try:
            await self._release(ticket)
        except _FAILURES as exc:
            self._note_failure(exc)
            self._owe(ticket).release = ticket

    @property
    def backlog(self) -> int:
        """Tickets whose release or settlement waits for Redis to answer again."""
        return len(self._backlog)

    async def aclose(self) -> None:
        """Stop the flusher and close the client, each within a bound: a Redis that went
        away (or came back) mid-retry must not hold up a shutdown."""
        if self._flusher is not None:
            self._flusher.cancel()
            _, late = await asyncio.wait({self._flusher}, timeout=_CLOSE_WAIT_S)
            if late:
                log.warning(
                    "limits_store_close_slow", step="backlog flusher", after_s=_CLOSE_WAIT_S
                )
        closing = asyncio.ensure_future(self._client.aclose())
        _, late = await asyncio.wait({closing}, timeout=_CLOSE_WAIT_S)
        if late:
            closing.cancel()
            log.warning("limits_store_close_slow", step="client close", after_s=_CLOSE_WAIT_S)

    # -- what ended requests owe Redis ---------------------------------------------------

    async def _settle(self, ticket: Ticket, delta: int) -> None:
        args = (ticket.limits.requests_per_minute or 0, ticket.limits.tokens_per_minute, delta)
        await self._script(_SETTLE, self.redis_keys(ticket.key)[:1], args)

    async def _release(self, ticket: Ticket) -> None:
        if self._in_retry_window():
            raise _InRetryWindow("limit store in its retry interval after a failure")
        await self._bounded(self._client.zrem(self.redis_keys(ticket.key)[1], ticket.id))
        self._note_success()

    def _owe(self, ticket: Ticket) -> _Owed:
        owed = self._backlog.get(ticket.id)
        if owed is None:
            owed = self._backlog[ticket.id] = _Owed()
            if len(self._backlog) > self._max_backlog:
                self._backlog.popitem(last=False)
                self.backlog_dropped += 1
        if self._flusher is None or self._flusher.done():
            self._flusher = self._supervisor.spawn(
                "limits_backlog", "limits-backlog", self._flush_backlog
            )
        return owed

    async def _flush_backlog(self) -> None:
        """Retry what is owed, oldest first, until the backlog is empty."""
        while self._backlog:
            await asyncio.sleep(max(self._retry_interval, 0.05))
            while self._backlog:
                ticket_id, owed = next(iter(self._backlog.items()))
                try:
                    if owed.settle is not None:
                        await self._settle(*owed.settle)
                        owed.settle = None
                    if owed.release is not None:
                        await self._release(owed.release)
                        owed.release = None
                except _FAILURES as exc:
                    self._note_failure(exc)
                    break  # still down: wait and try again
                self._backlog.pop(ticket_id, None)
        log.info("limits_backlog_flushed", dropped=self.backlog_dropped)

    # -- plumbing ----------------------------------------------------------------------------

    async def _script(self, script: _Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        if self._in_retry_window():
            raise _InRetryWindow("limit store in its retry interval after a failure")
        try:
            res = await self._bounded(self._client.evalsha(script.sha, len(keys), *keys, *args))
        except NoScriptError:  # a restarted or flushed Redis: EVAL also caches the script
            res = await self._bounded(self._client.eval(script.source, len(keys), *keys, *args))
        self._note_success()
        return res

    def _in_retry_window(self) -> bool:
        return self._down_since is not None and self._clock() < self._retry_at

    async def _bounded(self, call: Any) -> Any:
        try:
            async with asyncio.timeout(self._timeout):
                return await call
        except RedisConnectionError:
            # A restarted Redis closed every pooled connection; each idle one would fail on
            # its next use (minutes later, as load reaches it). Drop them all now.
            await self._client.connection_pool.disconnect(inuse_connections=False)
            raise

    def _unavailable(self, ticket: Ticket, exc: BaseException) -> LimitDecision:
        self._note_failure(exc)
        if ticket.limits.max_concurrent is not None and not isinstance(exc, _InRetryWindow):
            # The script may have run after we stopped waiting (a slow Redis answers late):
            # then it holds a slot under this ticket's id, which nobody else will give back.
            self._owe(ticket).release = ticket
        if not self.fail_open:
            raise LimitsUnavailable(
                "Rate limits cannot be checked right now; please retry shortly.",
                retry_after=self._retry_after,
            ) from exc
        return LimitDecision(
            allowed=True,
            ticket=Ticket(ticket.key, ticket.limits, ticket.reserved, accounted=False),
            degraded=True,
        )

    def _note_failure(self, exc: BaseException) -> None:
        if isinstance(exc, _InRetryWindow):
            return
        now = self._clock()
        self._retry_at = now + self._retry_interval
        if self._down_since is None:
            self._down_since = now
            log.warning(
                "limits_store_unavailable",
                error=f"{type(exc).__name__}: {exc}",
                failure_mode="open" if self.fail_open else "closed",
            )

    def _note_success(self) -> None:
        if self._down_since is not None:
            log.info(
                "limits_store_recovered",
                outage_s=round(self._clock() - self._down_since, 3),
            )
            self._down_since = None
