"""The admission queue: requests wait in the gateway while every backend is saturated.

The order is ``FairQueue``'s (priority, then round robin across keys); this module only waits.
Capacity is handed out one request at a time: a woken request must take its backend lease
(``Router.pick``, synchronous) before it next awaits, and the next waiter is woken only after
that, so one freed slot never releases the whole queue at once. ``notify()`` is called whenever
capacity may have freed (a request ended, a scrape arrived).

A waiter that is cancelled (client disconnect) or times out leaves the queue at once; a grant it
received in the same instant is passed on, so nothing is ever held by a request that is gone.

**Shed by priority** when the fleet cannot keep up: the queue knows how fast it drains (grants
over the last ``drain_window`` s) and how fast requests of each priority join it, so a new
request's wait is predicted from what waits ahead of it (its priority band and those above),
drained at what the fleet serves less what the higher priorities that keep arriving take (they
overtake it while it waits): ``(ahead + 1) / (drained - arriving above)``, without bound when
those above take all of it. Past its limit (the tier's ``max_wait``, or the queue's), it is
refused at once with 429 ``shed_by_priority`` and a ``Retry-After`` of that predicted wait
(of the window, when unbounded; at most a minute), rather than queued to time out: the lowest
priorities wait longest, so they are refused first (batch-class, below 0, before all). A
request that times out in the queue gets the same prediction as its ``Retry-After``. At a full
queue, a request of a higher priority than the lowest waiting one takes its place (that one is
refused, 429), instead of being refused itself.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Final

from backends.errors import QueueFull, QueueTimeout, Shed
from gateway.limits.fairqueue import FairQueue

# The longest Retry-After a prediction gives: past a minute it is the last 10 s's rates drawn
# out (4955 s once, with the fleet draining barely faster than the priorities above arrived).
MAX_RETRY_AFTER: Final = 60


class _Waiter:
    __slots__ = ("future", "granted")

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future = future
        self.granted = False


class AdmissionTicket:
    """Held from admission to the end of the request; ``release()`` is idempotent."""

    __slots__ = ("_queue", "queued", "released")

    def __init__(self, queue: AdmissionQueue, *, queued: bool) -> None:
        self._queue = queue
        self.queued = queued  # False when admitted without waiting
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._queue._ticket_released()


@dataclass(slots=True)
class AdmissionStats:
    admitted_at_once: int = 0
    admitted_after_wait: int = 0
    rejected_full: int = 0
    timed_out: int = 0
    cancelled: int = 0
    shed: int = 0  # refused by priority: on arrival (predicted wait) or from a full queue


class AdmissionQueue:
    def __init__(
        self,
        saturated: Callable[[], bool],
        *,
        max_size: int,
        max_wait: float,
        retry_after: int = 1,
        drain_window: float = 10.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._saturated = saturated
        self._max_size = max_size
        self._max_wait = max_wait
        self._retry_after = retry_after
        self._drain_window = drain_window
        self._clock = clock
        self._grants: deque[float] = deque(maxlen=4096)  # when requests left the queue
        self._joined: dict[int, deque[float]] = {}  # per priority: when requests joined it
        self._queue: FairQueue[_Waiter] = FairQueue()
        self._in_transit = 0  # granted, not yet resumed
        self.holding = 0  # tickets not yet released
        self.stats = AdmissionStats()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def in_transit(self) -> int:
        return self._in_transit

    def waiting_by_key(self) -> dict[str, int]:
        return self._queue.waiting_by_key()

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    def drain_rate(self) -> float | None:
        """Requests leaving the queue per second, over the last ``drain_window`` s (None: too
        few to tell)."""
        now = self._now()
        grants = self._grants
        while grants and now - grants[0] > self._drain_window:
            grants.popleft()
        if len(grants) < 2:
            return None
        return len(grants) / max(now - grants[0], 1e-3)

    def joining_above(self, priority: int) -> float:
        """Requests of a priority above ``priority`` joining the queue per second, over the
        last ``drain_window`` s."""
        now, window = self._now(), self._drain_window
        joined = 0
        for p in list(self._joined):
            times = self._joined[p]
            while times and now - times[0] > window:
                times.popleft()
            if not times:
                del self._joined[p]  # one entry per priority seen in the window, no more
            elif p > priority:
                joined += len(times)
        return joined / window

    def predicted_wait(self, priority: int) -> float | None:
        """How long a request of ``priority`` arriving now would wait (None: unknown;
        ``math.inf``: higher priorities keep arriving as fast as the queue drains)."""
        rate = self.drain_rate()
        if rate is None:
            return None
        left = rate - self.joining_above(priority)
        if left <= 0:
            return math.inf
        return (self._queue.ahead_of(priority) + 1) / left

    def _retry_after_for(self, wait: float | None) -> int:
        if wait is None:
            return self._retry_after
        if math.isinf(wait):  # the rates are measured anew over a window
            return max(1, math.ceil(self._drain_window))
        return min(MAX_RETRY_AFTER, max(1, math.ceil(wait)))

    async def acquire(
        self, key: str, priority: int = 0, max_wait: float | None = None
    ) -> AdmissionTicket:
        """Admit now if the fleet has room and nobody waits; else wait in line.

        Raises ``Shed`` (429) when its predicted wait is past ``max_wait`` (its tier's; at most
        the queue's), or it is the lowest priority at a full queue; ``QueueFull`` (503) at a
        full queue of requests of its priority or above; ``QueueTimeout`` (503) after its
        wait. Cancellation leaves the queue and holds nothing.
        """
        if not self._queue and not self._in_transit and not self._saturated():
            self.stats.admitted_at_once += 1
            return self._ticket(queued=False)
        limit = self._max_wait if max_wait is None else min(max_wait, self._max_wait)
        wait = self.predicted_wait(priority)
        if wait is not None and wait > limit:
            self.stats.shed += 1
            raise Shed(
                f"The fleet is overloaded: a request of priority {priority} would wait "
                + (
                    "as long as higher priorities keep arriving"
                    if math.isinf(wait)
                    else f"about {wait:.0f} s"
                )
                + f", over its {limit:g} s; please retry later.",
                retry_after=self._retry_after_for(wait),
            )
        if len(self._queue) >= self._max_size:
            self._make_room(priority)
        waiter = _Waiter(asyncio.get_running_loop().create_future())
        self._queue.push(waiter, key, priority)
        self._joined.setdefault(priority, deque(maxlen=4096)).append(self._now())
        self.notify()
        try:
            async with asyncio.timeout(limit):
                await waiter.future
        except TimeoutError:
            self._abandon(waiter)
            self.stats.timed_out += 1
            raise QueueTimeout(
                f"The request waited {limit:g}s for capacity; please retry later.",
                retry_after=self._retry_after_for(self.predicted_wait(priority)),
            ) from None
        except Shed:  # a request of a higher priority took its place (``_make_room``)
            self.stats.shed += 1
            raise
        except BaseException:
            self._abandon(waiter)
            self.stats.cancelled += 1
            raise
        self._in_transit -= 1
        self.stats.admitted_after_wait += 1
        # Wake the next waiter once this request has taken its lease (at its next await).
        asyncio.get_running_loop().call_soon(self.notify)
        return self._ticket(queued=True)

    @asynccontextmanager
    async def slot(
        self, key: str, priority: int = 0, max_wait: float | None = None
    ) -> AsyncIterator[AdmissionTicket]:
        ticket = await self.acquire(key, priority, max_wait)
        try:
            yield ticket
        finally:
            ticket.release()

    def _make_room(self, priority: int) -> None:
        """At a full queue: shed the lowest-priority waiter if it is lower than ``priority``,
        else refuse the newcomer (503, as a full queue always was)."""
        lowest = self._queue.lowest_priority()
        if lowest is None or lowest >= priority:
            self.stats.rejected_full += 1
            raise QueueFull(
                "The gateway's queue is full; please retry shortly.", retry_after=self._retry_after
            )
        shed = self._queue.lowest()
        assert shed is not None
        victim, its = shed
        victim.future.set_exception(
            Shed(
                f"The fleet is overloaded: a request of a higher priority than {its} took this "
                "one's place in the queue; please retry later.",
                retry_after=self._retry_after_for(self.predicted_wait(its)),
            )
        )

    def notify(self) -> None:
        """Capacity may have freed: wake the next waiter if the fleet has room."""
        while self._queue and not self._in_transit and not self._saturated():
            waiter = self._queue.pop()
            assert waiter is not None
            if waiter.future.done():  # cancelled, its task not yet run to leave the queue
                continue
            waiter.granted = True
            waiter.future.set_result(None)
            self._in_transit += 1
            self._grants.append(self._now())

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter.granted:  # the grant came as we left: hand it to the next in line
            self._in_transit -= 1
            self.notify()
        else:
            self._queue.remove(waiter)

    def _ticket(self, *, queued: bool) -> AdmissionTicket:
        self.holding += 1
        return AdmissionTicket(self, queued=queued)

    def _ticket_released(self) -> None:
        self.holding -= 1
        self.notify()
