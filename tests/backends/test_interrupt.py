"""``Interrupt``'s deadline: it ends an attempt's wait only if its confirmation agrees when
the time comes, told how late the event loop ran it."""

from __future__ import annotations

import asyncio
import time

from backends.upstream.client import Interrupt, Late


async def test_a_deadline_ends_the_wait_when_confirmed() -> None:
    interrupt = Interrupt()
    lags: list[float] = []
    interrupt.deadline(0.01, lambda lag: lags.append(lag) or True)
    await asyncio.sleep(0.05)  # sleep-ok: the deadline is a timer of 10 ms
    assert isinstance(interrupt.cause, Late)
    assert len(lags) == 1


async def test_a_refused_confirmation_keeps_waiting_and_a_busy_loop_is_seen() -> None:
    interrupt = Interrupt()
    lags: list[float] = []
    interrupt.deadline(0.01, lambda lag: lags.append(lag) and False)
    time.sleep(0.06)  # noqa: ASYNC251  # sleep-ok: the event loop kept busy past the deadline
    await asyncio.sleep(0.01)  # sleep-ok: let the late timer run
    assert interrupt.cause is None
    assert lags[0] >= 0.04  # it ran about 50 ms after its time


async def test_disarmed_before_the_deadline_nothing_fires() -> None:
    interrupt = Interrupt()
    called: list[float] = []
    interrupt.deadline(0.01, lambda lag: called.append(lag) or True)
    interrupt.disarm()  # the first bytes came
    await asyncio.sleep(0.03)  # sleep-ok: past the deadline
    assert called == []
    assert interrupt.cause is None
