"""A lease on Redis: one replica at a time holds a named duty (a rollout's driving), for ``ttl``
seconds unless it renews; if it dies, the lease lapses and another replica takes it.

Each new holder gets a fencing token, one more than the last holder's (``acquire``): a
replica that stalled past its ``ttl`` and comes back finds its renewal refused, and anything
it writes under the lease can be checked against the holder it claims to be (``held_by``,
the scripts' first test). Two keys per lease, under the caller's key: the holder (``<key>``,
with the expiry) and the token counter (``<key>:token``, never expiring). Redis errors are not
caught here: the caller decides (a driver that cannot renew stops driving).
"""

from __future__ import annotations

import math
from typing import Final

from redis.asyncio import Redis

# KEYS: holder, token. ARGV: holder id, ttl ms, the least token a new holder may get. The
# token, or nil if another holds it.
_ACQUIRE_LUA: Final = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end
if holder then return nil end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local token = redis.call('INCR', KEYS[2])
if token < tonumber(ARGV[3]) then
  token = tonumber(ARGV[3])
  redis.call('SET', KEYS[2], token)
end
return token
"""

# KEYS: holder. ARGV: holder id, ttl ms. 1 if still held (and extended), else 0.
_RENEW_LUA: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: holder. ARGV: holder id. 1 if it was held and is now free, else 0.
_RELEASE_LUA: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


class DutyLease:
    """``holder``'s claim on the duty ``key`` names, for ``ttl`` seconds at a time."""

    def __init__(self, redis: Redis, key: str, holder: str, ttl: float) -> None:
        if not (math.isfinite(ttl) and ttl > 0):
            raise ValueError("a lease's ttl must be a number of seconds > 0")
        self._redis = redis
        self.key = key
        self.token_key = key + ":token"
        self.holder = holder
        self._ttl_ms = max(round(ttl * 1000), 1)
        self.token: int | None = None  # while held: this holder's fencing token

    async def acquire(self, at_least: int = 0) -> int | None:
        """Take the lease (or extend it, if held already): its fencing token, or None if
        another holder has it. ``at_least``: the least token a new holder gets (the newest one
        the fleet has seen applied: a Redis that lost the counter must not hand out an older
        one)."""
        token = await self._redis.eval(
            _ACQUIRE_LUA, 2, self.key, self.token_key, self.holder, self._ttl_ms, at_least
        )
        self.token = None if token is None else int(token)
        return self.token

    async def renew(self) -> bool:
        """Extend the lease; False if it lapsed or another holder has it (stop the duty)."""
        kept = await self._redis.eval(_RENEW_LUA, 1, self.key, self.holder, self._ttl_ms)
        if not kept:
            self.token = None
        return bool(kept)

    async def release(self) -> bool:
        """Give the lease up (if still held), so another may take it at once."""
        self.token = None
        freed = await self._redis.eval(_RELEASE_LUA, 1, self.key, self.holder)
        return bool(freed)

    async def held_by(self) -> str | None:
        """Who holds the lease now (None: nobody)."""
        holder = await self._redis.get(self.key)
        return (
            None
            if holder is None
            else holder.decode()
            if isinstance(holder, bytes)
            else str(holder)
        )
