"""Sleep mode's operations, run against the engine driver on the event loop.

``sleep.py`` says what each operation does to the state; this module does it to the engine
and takes the time it takes:

- ``sleep``: pause scheduling (``keep``: everything; ``abort``, ``wait``: admitting), then
  in mode ``abort`` abort every request (their answers end with ``finish_reason`` ``abort``),
  in mode ``wait`` wait until the running ones have finished; at levels 1 and 2 the KV
  cache is discarded (a request kept with ``keep`` is recomputed once awake). Done then.
- ``wake_up``: wait the wake's time (``Sleep.wake``) on the real clock, then resume
  scheduling if nothing is left asleep: the queued requests run.

One operation runs at a time, in the order they came, each in a task of its own: a client
that gives up does not stop it, as it does not stop vLLM's engine. The time each took
(queueing behind another included) goes to vLLM's
``vllm:sleep_mode_operation_duration_seconds`` histogram; those under way to
``vllm:sleep_mode_operations_in_flight``. ``done`` lists them in the order they ran (the
simulator's own, for tests: an engine put to sleep twice without a wake in between shows).

``wait`` is the seam through which a wake's time passes (``asyncio.sleep``); a test can
replace it, e.g. with one that waits for an event, to look at the engine mid-wake.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, Literal

import structlog

from tools.sim.config import SimConfig
from tools.sim.driver import EngineDriver
from tools.sim.sleep import GpuMemory, Sleep, SleepRequest
from tools.sim.stats import Histogram

log = structlog.get_logger(__name__)

Operation = Literal["sleep", "wake"]
OPERATIONS: Final[tuple[Operation, ...]] = ("sleep", "wake")
# vLLM's buckets for vllm:sleep_mode_operation_duration_seconds
DURATION_BUCKETS: Final = (0.01, 0.1, 1.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True, slots=True)
class SleepReport:
    """What ``/metrics`` and ``/sim/state`` show of sleep mode, taken at once."""

    state: Sleep
    waking: bool
    memory: GpuMemory
    durations: dict[Operation, tuple[list[tuple[str, int]], float]]  # cumulative, sum
    in_flight: dict[Operation, int]


class SleepMode:
    """Sleep mode of one simulator; see the module docstring."""

    def __init__(self, config: SimConfig, driver: EngineDriver, clock: Callable[[], float]) -> None:
        self.config = config
        self.state = Sleep()
        self.waking = False  # a wake's time is passing
        self.wait: Callable[[float], Awaitable[None]] = asyncio.sleep
        self._driver = driver
        self._clock = clock
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._durations = {op: Histogram(DURATION_BUCKETS) for op in OPERATIONS}
        self._in_flight: dict[Operation, int] = dict.fromkeys(OPERATIONS, 0)
        self.done: list[Operation] = []  # every operation run, in order

    async def sleep(self, request: SleepRequest) -> None:
        """``POST /sleep``: returns once asleep."""
        await self._run("sleep", lambda: self._sleep(request))

    async def wake_up(self, tags: frozenset[str] | None) -> None:
        """``POST /wake_up``: returns once the tags asked for are awake."""
        await self._run("wake", lambda: self._wake(tags))

    async def close(self) -> None:
        """Cancel the operations under way (the app is stopping)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def report(self) -> SleepReport:
        return SleepReport(
            state=self.state,
            waking=self.waking,
            memory=self.state.memory(self.config),
            durations={op: (h.cumulative(), h.sum) for op, h in self._durations.items()},
            in_flight=dict(self._in_flight),
        )

    async def _run(self, op: Operation, work: Callable[[], Awaitable[None]]) -> None:
        task = asyncio.get_running_loop().create_task(self._timed(op, work), name=f"sim-{op}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await asyncio.shield(task)

    async def _timed(self, op: Operation, work: Callable[[], Awaitable[None]]) -> None:
        started = self._clock()
        self._in_flight[op] += 1
        try:
            async with self._lock:
                await work()
                self.done.append(op)
        finally:
            self._in_flight[op] -= 1
            self._durations[op].observe(self._clock() - started)

    async def _sleep(self, request: SleepRequest) -> None:
        driver = self._driver
        driver.pause("paused_all" if request.mode == "keep" else "paused_new")
        self.state = self.state.pausing()
        aborted = driver.abort_all() if request.mode == "abort" else 0
        if request.mode == "wait":
            await driver.drained()
        if request.level >= 1:
            driver.drop_kv_cache()
        self.state = self.state.slept(request.level)
        log.info("sim_sleep", sleep_level=request.level, mode=request.mode, aborted=aborted)

    async def _wake(self, tags: frozenset[str] | None) -> None:
        plan = self.state.wake(tags, self.config)
        if plan.seconds > 0:
            self.waking = True
            try:
                await self.wait(plan.seconds)
            finally:
                self.waking = False
        self.state = plan.after
        if not plan.after.paused:
            self._driver.resume()
        log.info(
            "sim_wake_up",
            tags=None if tags is None else sorted(tags),
            woken=sorted(plan.woken),
            seconds=plan.seconds,
            awake=not plan.after.is_sleeping,
        )
