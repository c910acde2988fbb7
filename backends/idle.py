"""Idle timeouts for upstream streams, at the cost of one integer increment per read.

aiohttp's own ``sock_read`` timeout re-arms a loop timer on every read, which on a token
stream (one read per token) was the largest single cost of the relay. Here each stream bumps a
counter when data arrives, and one sweep per interval finds the streams whose counter has not
moved for ``timeout`` seconds. The decision is pure (``sweep`` takes the time as an argument);
the loop that calls it is the only I/O.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class IdleWatch:
    """One stream's activity counter; the relay does ``watch.activity += 1`` per read."""

    __slots__ = ("_last_change", "_seen", "activity", "fired", "on_idle")

    def __init__(self, on_idle: Callable[[], None], now: float) -> None:
        self.activity = 0
        self.fired = False
        self.on_idle = on_idle
        self._seen = 0
        self._last_change = now


class IdleWatchdog:
    def __init__(self, timeout: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        # Granularity of the check: a stream is cut between timeout and timeout + interval.
        self.interval = min(1.0, timeout / 4)
        self._clock = clock
        self._watches: set[IdleWatch] = set()

    def __len__(self) -> int:
        return len(self._watches)

    def watch(self, on_idle: Callable[[], None]) -> IdleWatch:
        w = IdleWatch(on_idle, self._clock())
        self._watches.add(w)
        return w

    def unwatch(self, w: IdleWatch) -> None:
        self._watches.discard(w)

    def sweep(self, now: float) -> list[IdleWatch]:
        """Fire and forget every watch idle for ``timeout``; return those that fired."""
        fired: list[IdleWatch] = []
        for w in self._watches:
            if w.activity != w._seen:
                w._seen = w.activity
                w._last_change = now
            elif now - w._last_change >= self.timeout:
                fired.append(w)
        for w in fired:
            self._watches.discard(w)
            w.fired = True
            w.on_idle()
        return fired

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.sweep(self._clock())
