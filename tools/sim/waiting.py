"""The engine's queue of waiting requests, in its scheduling policy's order (vLLM's
``request_queue.py``). Pure.

- ``fcfs``: arrival order; a preempted request goes back to the front.
- ``priority``: by ``order`` — (priority, arrival, id), smallest first — whether a request
  is new or preempted (a priority queue has no front to put it back at).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from tools.sim.config import SchedulingPolicy

Order = tuple[int, float, int]  # (priority, arrival, request id): unique per request


class Queued(Protocol):
    @property
    def order(self) -> Order: ...


T = TypeVar("T", bound=Queued)


class WaitingQueue(Protocol[T]):
    """What the scheduler needs of its queue; ``peek``/``pop`` give the next to admit."""

    def add(self, item: T) -> None: ...
    def prepend(self, item: T) -> None: ...
    def peek(self) -> T: ...
    def pop(self) -> T: ...
    def remove(self, item: T) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[T]: ...


class FcfsQueue(Generic[T]):
    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: deque[T] = deque()

    def add(self, item: T) -> None:
        self._items.append(item)

    def prepend(self, item: T) -> None:
        self._items.appendleft(item)

    def peek(self) -> T:
        return self._items[0]

    def pop(self) -> T:
        return self._items.popleft()

    def remove(self, item: T) -> None:
        self._items.remove(item)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)


class PriorityQueue(Generic[T]):
    """A heap on ``order``; iterated in that order."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[Order, T]] = []  # orders are unique: items are never compared

    def add(self, item: T) -> None:
        heapq.heappush(self._heap, (item.order, item))

    prepend = add

    def peek(self) -> T:
        return self._heap[0][1]

    def pop(self) -> T:
        return heapq.heappop(self._heap)[1]

    def remove(self, item: T) -> None:
        for i, (_, queued) in enumerate(self._heap):
            if queued is item:
                last = self._heap.pop()
                if i < len(self._heap):
                    self._heap[i] = last
                    heapq.heapify(self._heap)
                return
        raise ValueError("not in the queue")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[T]:
        return (item for _, item in sorted(self._heap, key=_order))


def _order(entry: tuple[Order, object]) -> Order:
    return entry[0]


def waiting_queue(policy: SchedulingPolicy) -> WaitingQueue[T]:
    """An empty queue for ``policy``."""
    if policy == "priority":
        return PriorityQueue()
    return FcfsQueue()
