"""The admission queue: fair order (pure), waiting, timeouts, cancellation and no leaks."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest

from backends.errors import QueueFull, QueueTimeout
from gateway.limits.admission import MAX_RETRY_AFTER, AdmissionQueue, AdmissionTicket
from gateway.limits.fairqueue import (
    FairQueue,
    SaturationThresholds,
    fleet_saturated,
    parse_priority,
)
from policies import BackendSnapshot
from tests.waiting import wait_for

# -- pure order ------------------------------------------------------------------------------


def drain(q: FairQueue[str]) -> list[str]:
    out = []
    while (item := q.pop()) is not None:
        out.append(item)
    return out


def test_round_robin_across_keys_fifo_within_a_key() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.push(f"a{i}", "a")
    q.push("b0", "b")
    q.push("c0", "c")
    q.push("b1", "b")
    assert drain(q) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    assert len(q) == 0


def test_higher_priority_first_then_fair_within_the_band() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("low-a", "a", -1)
    q.push("mid-a", "a", 0)
    q.push("high-b0", "b", 5)
    q.push("high-b1", "b", 5)
    q.push("high-c0", "c", 5)
    assert drain(q) == ["high-b0", "high-c0", "high-b1", "mid-a", "low-a"]


def test_remove_takes_an_item_out_from_anywhere() -> None:
    q: FairQueue[str] = FairQueue()
    for item, key in [("a0", "a"), ("a1", "a"), ("b0", "b")]:
        q.push(item, key)
    assert q.remove("a0")
    assert not q.remove("a0")
    assert q.remove("b0")
    assert q.waiting_by_key() == {"a": 1}
    assert drain(q) == ["a1"]
    assert q.pop() is None


def test_priority_header_is_clamped_to_the_tier() -> None:
    assert parse_priority(None, 5) == 0
    assert parse_priority("3", 5) == 3
    assert parse_priority("9", 5) == 5
    assert parse_priority("-7", 0) == -7
    assert parse_priority("-1000", 0) == -100
    assert parse_priority("high", 5) == 0


def test_fleet_is_saturated_only_when_every_backend_reaches_a_threshold() -> None:
    th = SaturationThresholds(max_queue_depth=4, max_kv_usage=0.9, max_in_flight=10)
    busy = BackendSnapshot(id="a", in_flight=10)
    queued = BackendSnapshot(id="b", in_flight=0, queue_depth=4, running=1, kv_cache_usage=0.1)
    full_kv = BackendSnapshot(id="c", in_flight=0, queue_depth=0, running=1, kv_cache_usage=0.95)
    idle = BackendSnapshot(id="d", in_flight=1, queue_depth=0, running=1, kv_cache_usage=0.2)
    unscraped = BackendSnapshot(id="e", in_flight=1)
    assert fleet_saturated([busy, queued, full_kv], th)
    assert not fleet_saturated([busy, queued, idle], th)
    assert not fleet_saturated([unscraped], th)
    assert not fleet_saturated([], th)
    assert not fleet_saturated([busy], SaturationThresholds())


# -- waiting ---------------------------------------------------------------------------------


@dataclass
class Fleet:
    """A fleet of ``cap`` slots: saturated when that many requests are in flight."""

    cap: int
    in_flight: int = 0
    paused: bool = False
    peak: int = 0

    def saturated(self) -> bool:
        return self.paused or self.in_flight >= self.cap

    def start(self) -> None:  # what taking a backend lease does
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)


def queue_for(fleet: Fleet, *, max_size: int = 100, max_wait: float = 30.0) -> AdmissionQueue:
    return AdmissionQueue(fleet.saturated, max_size=max_size, max_wait=max_wait, retry_after=2)


async def test_admits_at_once_when_the_fleet_has_room() -> None:
    fleet = Fleet(cap=2)
    q = queue_for(fleet)
    async with q.slot("k") as ticket:
        assert not ticket.queued
        assert q.holding == 1
    assert q.holding == 0


async def test_a_bursting_key_cannot_starve_a_quiet_one() -> None:
    fleet = Fleet(cap=1)
    q = queue_for(fleet)
    holder = await q.acquire("a")
    fleet.start()
    order: list[str] = []

    async def request(key: str) -> None:
        ticket = await q.acquire(key)
        fleet.start()
        order.append(key)
        await asyncio.sleep(0)  # sleep-ok: one loop turn "at the backend"
        fleet.in_flight -= 1
        ticket.release()

    burst = [asyncio.create_task(request("a")) for _ in range(20)]
    await wait_for(lambda: q.waiting == 20, what="the burst to queue")
    quiet = asyncio.create_task(request("b"))
    await wait_for(lambda: q.waiting == 21, what="the quiet request to queue")
    fleet.in_flight -= 1
    holder.release()
    await asyncio.gather(*burst, quiet)
    assert order.index("b") <= 1  # FIFO would have made it 21st
    assert fleet.peak == 1


async def test_higher_priority_waiter_goes_first() -> None:
    fleet = Fleet(cap=1)
    q = queue_for(fleet)
    holder = await q.acquire("x")
    fleet.start()
    order: list[str] = []

    async def request(name: str, priority: int) -> None:
        async with q.slot(name, priority):
            fleet.start()
            order.append(name)
            fleet.in_flight -= 1

    tasks = [asyncio.create_task(request(f"low{i}", 0)) for i in range(3)]
    await wait_for(lambda: q.waiting == 3)
    tasks.append(asyncio.create_task(request("high", 3)))
    await wait_for(lambda: q.waiting == 4)
    fleet.in_flight -= 1
    holder.release()
    await asyncio.gather(*tasks)
    assert order[0] == "high"


async def test_max_wait_is_honoured_with_a_503_and_retry_after() -> None:
    fleet = Fleet(cap=1, paused=True)
    q = queue_for(fleet, max_wait=0.05)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(QueueTimeout) as info:
        await q.acquire("k")
    assert loop.time() - started >= 0.05
    assert info.value.status == 503
    assert info.value.headers["Retry-After"] == "2"
    assert (q.waiting, q.in_transit, q.holding) == (0, 0, 0)


async def test_a_full_queue_refuses_at_once() -> None:
    fleet = Fleet(cap=1, paused=True)
    q = queue_for(fleet, max_size=2)
    waiters = [asyncio.create_task(q.acquire("k")) for _ in range(2)]
    await wait_for(lambda: q.waiting == 2)
    with pytest.raises(QueueFull):
        await q.acquire("other")
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert q.waiting == 0


async def test_a_disconnect_while_queued_leaves_at_once_and_holds_nothing() -> None:
    fleet = Fleet(cap=1)
    q = queue_for(fleet)
    holder = await q.acquire("k")
    fleet.start()
    waiter = asyncio.create_task(q.acquire("k"))
    await wait_for(lambda: q.waiting == 1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (q.waiting, q.in_transit, q.holding) == (0, 0, 1)
    fleet.in_flight -= 1
    holder.release()
    assert (q.waiting, q.in_transit, q.holding) == (0, 0, 0)


async def test_a_grant_arriving_as_the_waiter_disconnects_passes_to_the_next() -> None:
    fleet = Fleet(cap=1)
    q = queue_for(fleet)
    holder = await q.acquire("k")
    fleet.start()
    first = asyncio.create_task(q.acquire("a"))
    second = asyncio.create_task(q.acquire("b"))
    await wait_for(lambda: q.waiting == 2)
    fleet.in_flight -= 1
    holder.release()  # grants `first` synchronously...
    assert q.in_transit == 1
    first.cancel()  # ...which goes away before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    ticket = await second
    assert isinstance(ticket, AdmissionTicket)
    assert (q.waiting, q.in_transit, q.holding) == (0, 0, 1)
    ticket.release()
    ticket.release()
    assert q.holding == 0


async def test_no_slot_leak_after_a_thousand_mixed_requests() -> None:
    """Admitted, cancelled while queued and timed out, interleaved: nothing left held."""
    rng = random.Random(5)
    fleet = Fleet(cap=3)
    q = queue_for(fleet, max_size=2000, max_wait=0.05)
    unstall = asyncio.Event()
    outcomes: list[str] = []

    async def request(key: str, priority: int, stall: bool, turns: int) -> None:
        try:
            async with q.slot(key, priority):
                fleet.start()
                assert fleet.in_flight <= fleet.cap
                try:
                    if stall:
                        await unstall.wait()
                    for _ in range(turns):
                        await asyncio.sleep(0)  # sleep-ok: loop turns "at the backend"
                finally:
                    fleet.in_flight -= 1
            outcomes.append("done")
        except QueueTimeout:
            outcomes.append("timeout")
        except asyncio.CancelledError:
            outcomes.append("cancelled")
            raise

    tasks = []
    for i in range(1000):
        task = asyncio.create_task(
            request(
                f"k{rng.randrange(10)}", rng.choice([-1, 0, 0, 1]), i % 50 == 0, rng.randrange(4)
            )
        )
        tasks.append(task)
        if rng.random() < 0.2:
            task.get_loop().call_later(rng.random() * 0.02, task.cancel)
    # The first stalled requests hold every slot until some waiters have timed out.
    await wait_for(lambda: q.stats.timed_out >= 20, within=20, what="timeouts")
    unstall.set()
    await asyncio.gather(*tasks, return_exceptions=True)

    assert len(outcomes) == 1000
    assert {"done", "timeout", "cancelled"} <= set(outcomes)
    assert (q.waiting, q.in_transit, q.holding, fleet.in_flight) == (0, 0, 0, 0)
    assert fleet.peak <= fleet.cap
    async with q.slot("after") as ticket:
        assert not ticket.queued


# -- shed by priority --------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def draining_at(
    rate: float, clock: Clock, room: list[bool], warm: int = -10, **kw: float
) -> AdmissionQueue:
    """A saturated queue that has let ``rate`` requests a second (of priority ``warm``)
    through for 10 s."""
    q = AdmissionQueue(lambda: not room[0], clock=clock, **kw)  # type: ignore[arg-type]
    tickets = []
    for _ in range(int(rate * 10)):
        waiter = asyncio.create_task(q.acquire("warm", warm))
        await wait_for(lambda: q.waiting == 1, what="queued")
        room[0] = True
        q.notify()  # let through: one grant, at the clock's time
        room[0] = False
        tickets.append(await waiter)
        clock.t += 1 / rate
    for t in tickets:
        t.release()
    return q


def test_the_lowest_band_is_shed_first_newest_first() -> None:
    q: FairQueue[str] = FairQueue()
    for item, key, p in [("hi", "a", 5), ("lo0", "b", -1), ("lo1", "b", -1), ("mid", "c", 0)]:
        q.push(item, key, p)
    assert q.ahead_of(0) == 2
    assert q.ahead_of(-1) == 4
    assert q.lowest() == ("lo1", -1)
    assert q.lowest() == ("lo0", -1)
    assert q.lowest_priority() == 0


async def test_a_request_whose_predicted_wait_is_past_its_limit_is_shed_with_retry_after() -> None:
    from backends.errors import Shed

    clock, room = Clock(), [False]
    q = await draining_at(2.0, clock, room, max_size=100, max_wait=30.0)  # 2 a second
    high = [asyncio.create_task(q.acquire(f"h{i}", 5)) for i in range(10)]
    await asyncio.sleep(0)
    assert q.waiting == 10
    # a low-priority one waits behind all ten, drained at 2 a second less the 1 a second of
    # priority 5 that joined over the window and will overtake it: 11 s, over its tier's 3 s
    with pytest.raises(Shed) as shed:
        await q.acquire("batch", -1, max_wait=3.0)
    assert shed.value.status == 429
    assert shed.value.headers["Retry-After"] == "11"
    # the same wait is within a patient tier's limit: queued
    patient = asyncio.create_task(q.acquire("patient", -1, max_wait=20.0))
    await asyncio.sleep(0)
    assert q.waiting == 11
    assert q.stats.shed == 1
    for task in [*high, patient]:
        task.cancel()
    await asyncio.gather(*high, patient, return_exceptions=True)
    assert q.waiting == 0


async def test_a_retry_after_is_at_most_a_minute() -> None:
    from backends.errors import Shed

    clock, room = Clock(), [False]
    q = await draining_at(2.0, clock, room, max_size=1000, max_wait=1000.0)
    queued = [asyncio.create_task(q.acquire(f"k{i}", 0)) for i in range(150)]
    await asyncio.sleep(0)
    assert q.waiting == 150
    with pytest.raises(Shed) as shed:  # 151 ahead at 2 a second: 75.5 s, over its 20 s
        await q.acquire("late", 0, max_wait=20.0)
    assert shed.value.headers["Retry-After"] == str(MAX_RETRY_AFTER)
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)


async def test_while_higher_priorities_arrive_as_fast_as_it_drains_a_lower_one_is_shed() -> None:
    """The fleet serves 2 a second and requests of priority 0 have joined at 2 a second: one of
    priority -1 would never be served, however short the queue; priority 0 itself still
    waits its turn."""
    from backends.errors import Shed

    clock, room = Clock(), [False]
    q = await draining_at(2.0, clock, room, warm=0, max_size=100, max_wait=30.0)
    assert q.joining_above(-1) == pytest.approx(2.0, abs=0.1)
    with pytest.raises(Shed) as shed:
        await q.acquire("batch", -1, max_wait=20.0)
    assert shed.value.headers["Retry-After"] == "10"  # the rates are measured over 10 s
    assert "as long as higher priorities keep arriving" in shed.value.message
    same = asyncio.create_task(q.acquire("standard", 0, max_wait=20.0))
    await asyncio.sleep(0)
    assert q.waiting == 1
    clock.t += 11.0  # a window later, nobody joined: the rates forget them
    assert q.joining_above(-1) == 0.0
    same.cancel()
    await asyncio.gather(same, return_exceptions=True)
    assert q.waiting == 0


async def test_a_request_timed_out_in_the_queue_is_told_the_predicted_wait() -> None:
    clock, room = Clock(), [False]
    q = await draining_at(20.0, clock, room, max_size=100, max_wait=30.0, retry_after=1)
    queued = [asyncio.create_task(q.acquire(f"k{i}", 0)) for i in range(7)]
    await asyncio.sleep(0)
    late = asyncio.create_task(q.acquire("late", 0, max_wait=0.5))  # predicted: 0.4 s
    await wait_for(lambda: q.waiting == 8, what="queued")
    clock.t += 8.5  # nothing let through for 8.5 s: 30 in the last 10 s
    with pytest.raises(QueueTimeout) as info:
        await late
    # seven ahead of a new one: 8 / 3 a second = 2.7 s, nobody of a higher priority joining
    assert info.value.headers["Retry-After"] == "3"
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)


async def test_at_a_full_queue_a_higher_priority_takes_the_lowest_ones_place() -> None:
    from backends.errors import Shed

    q = AdmissionQueue(lambda: True, max_size=2, max_wait=30.0)
    low = asyncio.create_task(q.acquire("low", -5))
    mid = asyncio.create_task(q.acquire("mid", 0))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):  # as low as the lowest waiting: refused itself
        await q.acquire("another-low", -5)
    high = asyncio.create_task(q.acquire("high", 3))
    with pytest.raises(Shed):
        await low
    assert q.waiting == 2
    assert (q.stats.shed, q.stats.rejected_full) == (1, 1)
    for task in (mid, high):
        task.cancel()
    await asyncio.gather(mid, high, return_exceptions=True)
    assert q.waiting == 0
    assert q.holding == 0
