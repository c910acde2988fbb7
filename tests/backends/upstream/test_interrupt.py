"""``Interrupt``: the request path ends an attempt's wait with the error it names, and its
timer calls back only while the wait is on, told how late the event loop ran it."""

from __future__ import annotations

import asyncio
import time

from backends.errors import BackendDown
from backends.upstream.client import Ended, Interrupt


async def test_a_timer_calls_back_once_while_the_wait_is_on() -> None:
    interrupt = Interrupt()
    fired = asyncio.Event()
    lags: list[float] = []

    def due(lag: float) -> None:
        lags.append(lag)
        fired.set()

    interrupt.after(0.01, due)
    await asyncio.wait_for(fired.wait(), 5)
    assert len(lags) == 1
    assert interrupt.cause is None  # calling back is not ending: the request path decides


async def test_a_busy_loop_is_seen_in_the_lag() -> None:
    interrupt = Interrupt()
    lags: list[float] = []
    interrupt.after(0.01, lags.append)
    time.sleep(0.06)  # noqa: ASYNC251  # sleep-ok: the event loop kept busy past the timer
    await asyncio.sleep(0.01)  # sleep-ok: let the late timer run
    assert lags[0] >= 0.04  # it ran about 50 ms after its time


async def test_disarmed_before_the_timer_nothing_calls_back() -> None:
    interrupt = Interrupt()
    called: list[float] = []
    interrupt.after(0.01, called.append)
    interrupt.disarm()  # the first bytes came
    await asyncio.sleep(0.03)  # sleep-ok: past the timer
    assert called == []


def test_end_carries_the_named_error_and_only_the_first_counts() -> None:
    interrupt = Interrupt()
    first, second = BackendDown("backend a: marked down"), BackendDown("backend a: again")
    interrupt.end(first)
    interrupt.end(second)
    assert isinstance(interrupt.cause, Ended)
    assert interrupt.cause.error is first


def test_a_taken_interrupt_is_not_ended() -> None:
    interrupt = Interrupt()
    assert interrupt.take()  # the stream is the client's now
    interrupt.end(BackendDown("backend a: marked down"))
    assert interrupt.cause is None
