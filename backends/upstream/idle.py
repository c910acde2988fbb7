"""Idle and stall timeouts for upstream streams, at the cost of one integer increment per read.

aiohttp's own ``sock_read`` timeout re-arms a loop timer on every read, which on a token
stream (one read per token) was the largest single cost of the relay. Here each stream bumps a
counter when data arrives, and one sweep per interval finds the streams whose counter has not
moved for ``timeout`` seconds. The decision is pure (``sweep`` takes the time as an argument);
the loop that calls it is the only I/O.

The same sweep finds a stalled backend: one whose begun streams have all stood still for
``stall_after`` seconds, as an engine that hangs with requests in flight while its ``/health``
still answers does (new requests it takes get their head and nothing more). Each of its
streams is cut with ``stalled`` set (so the request path continues it elsewhere) and
``on_stall`` names the backend (the pool takes it out of rotation). A stream the relay stopped
reading because its client reads slower than the backend writes (``held``) is neither idle nor
a sign of a stall: that is the client's doing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class IdleWatch:
    """One stream's activity counter; the relay does ``watch.activity += 1`` per read."""

    __slots__ = (
        "_last_change",
        "_seen",
        "activity",
        "backend",
        "fired",
        "held",
        "on_idle",
        "stalled",
    )

    def __init__(self, on_idle: Callable[[], None], now: float, backend: str | None = None) -> None:
        self.activity = 0
        self.fired = False
        self.stalled = False  # cut because its whole backend stalled, not on its own
        # The client is holding the stream back (its reads are slower than the backend's
        # writes, so the relay stopped reading): standing still is the client's doing, not
        # the backend's. Neither idle nor a sign of a stall while set; its clock restarts
        # when it is cleared.
        self.held = False
        self.on_idle = on_idle
        self.backend = backend
        self._seen = 0
        self._last_change = now


class IdleWatchdog:
    def __init__(
        self,
        timeout: float,
        *,
        stall_after: float = 0.0,
        on_stall: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout = timeout
        self.stall_after = stall_after  # 0: no stall detection
        self.on_stall = on_stall
        # Granularity of the check: a stream is cut between timeout and timeout + interval.
        shortest = min(timeout, stall_after) if stall_after > 0 else timeout
        self.interval = min(1.0, shortest / 4)
        self._clock = clock
        self._watches: set[IdleWatch] = set()
        self._suspect: set[str] = set()  # stalled, and no byte from them since

    def __len__(self) -> int:
        return len(self._watches)

    def watch(self, on_idle: Callable[[], None], backend: str | None = None) -> IdleWatch:
        w = IdleWatch(on_idle, self._clock(), backend)
        self._watches.add(w)
        return w

    def unwatch(self, w: IdleWatch) -> None:
        self._watches.discard(w)

    def sweep(self, now: float) -> list[IdleWatch]:
        """Fire and forget every watch idle for ``timeout``, and every watch of a stalled
        backend; return those that fired."""
        fired: list[IdleWatch] = []
        for w in self._watches:
            if w.held:
                w._last_change = now
                continue
            if w.activity != w._seen:
                w._seen = w.activity
                w._last_change = now
                if w.backend is not None:
                    self._suspect.discard(w.backend)
            elif now - w._last_change >= self.timeout:
                fired.append(w)
        stalled = self.stalled(now) if self.stall_after > 0 else set()
        self._suspect |= stalled
        if stalled:
            for w in self._watches:
                if w.backend in stalled and w not in fired:
                    w.stalled = True
                    fired.append(w)
        for w in fired:
            self._watches.discard(w)
            w.fired = True
            w.on_idle()
        for backend in sorted(stalled):
            if self.on_stall is not None:
                self.on_stall(backend)
        return fired

    def stalled(self, now: float) -> set[str]:
        """Backends with streams begun, every one of which has stood still for
        ``stall_after``. Streams still waiting for their first byte do not count either way:
        alone they may be a long prefill, and beside stalled ones they are what a hung
        engine does to new requests (they are cut too, and retried elsewhere). On a backend
        that stalled and has sent no byte since, they count: its first request back (the
        circuit's trial) waiting that long for its first byte is a stall again."""
        latest: dict[str, float] = {}
        suspect = self._suspect
        for w in self._watches:
            b = w.backend
            if w.held:
                continue  # a slow client's stream says nothing of its backend
            if b is not None and (w.activity or b in suspect):
                latest[b] = max(latest.get(b, w._last_change), w._last_change)
        return {b for b, t in latest.items() if now - t >= self.stall_after}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.sweep(self._clock())
