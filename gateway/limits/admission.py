"""The admission queue: requests wait in the gateway while every backend is saturated.

The order is ``FairQueue``'s (priority, then round robin across keys); this module only waits.
Capacity is handed out one request at a time: a woken request must take its backend lease
(``Router.pick``, synchronous) before it next awaits, and the next waiter is woken only after
that, so one freed slot never releases the whole queue at once. ``notify()`` is called whenever
capacity may have freed (a request ended, a scrape arrived).

A waiter that is cancelled (client disconnect) or times out leaves the queue at once; a grant it
received in the same instant is passed on, so nothing is ever held by a request that is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from backends.errors import QueueFull, QueueTimeout
from gateway.limits.fairqueue import FairQueue


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


class AdmissionQueue:
    def __init__(
        self,
        saturated: Callable[[], bool],
        *,
        max_size: int,
        max_wait: float,
        retry_after: int = 1,
    ) -> None:
        self._saturated = saturated
        self._max_size = max_size
        self._max_wait = max_wait
        self._retry_after = retry_after
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

    async def acquire(self, key: str, priority: int = 0) -> AdmissionTicket:
        """Admit now if the fleet has room and nobody waits; else wait in line.

        Raises ``QueueFull`` (503) when the queue is at its bound and ``QueueTimeout`` (503)
        after ``max_wait``. Cancellation leaves the queue and holds nothing.
        """
        if not self._queue and not self._in_transit and not self._saturated():
            self.stats.admitted_at_once += 1
            return self._ticket(queued=False)
        if len(self._queue) >= self._max_size:
            self.stats.rejected_full += 1
            raise QueueFull(
                "The gateway's queue is full; please retry shortly.", retry_after=self._retry_after
            )
        waiter = _Waiter(asyncio.get_running_loop().create_future())
        self._queue.push(waiter, key, priority)
        self.notify()
        try:
            async with asyncio.timeout(self._max_wait):
                await waiter.future
        except TimeoutError:
            self._abandon(waiter)
            self.stats.timed_out += 1
            raise QueueTimeout(
                f"The request waited {self._max_wait:g}s for capacity; please retry shortly.",
                retry_after=self._retry_after,
            ) from None
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
    async def slot(self, key: str, priority: int = 0) -> AsyncIterator[AdmissionTicket]:
        ticket = await self.acquire(key, priority)
        try:
            yield ticket
        finally:
            ticket.release()

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
