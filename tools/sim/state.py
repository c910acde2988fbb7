"""What one simulator app shares between its handlers: engine, driver, faults, counters,
sleep mode."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable

import structlog

from tools.sim.config import SimConfig
from tools.sim.driver import EngineDriver, RequestHandle
from tools.sim.engine import Engine, EngineSnapshot
from tools.sim.faults import Faults
from tools.sim.responses_api import ResponseStore
from tools.sim.sleep_mode import SleepMode

log = structlog.get_logger(__name__)

FaultsListener = Callable[[Faults], None]


class SimState:
    """The simulator behind one app. ``faults`` can be replaced at any time."""

    def __init__(
        self,
        config: SimConfig,
        faults: Faults | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.engine = Engine(config, start=clock())
        self.driver = EngineDriver(self.engine, clock)
        self.sleep = SleepMode(config, self.driver, clock)
        self.rng = random.Random(config.seed)
        self.in_flight = 0
        self.injected_errors = 0
        self.audio_bytes = 0  # audio uploads received whole (the speech-to-text endpoints)
        self.engine_id = str(uuid.uuid4())  # as a KV connector names its engine
        self.prefills_handed_off = 0  # prefill-only requests answered with kv_transfer_params
        self.responses = ResponseStore()  # the Responses API's stored responses
        self.adapters: dict[str, str] = dict(config.lora_modules)  # LoRA name -> path
        # /inference/v1/generate requests running, by their id, for abort_requests
        self.generate_requests: dict[str, list[RequestHandle]] = {}
        self.ready = asyncio.Event()
        self.engine_dead = False
        self._faults = Faults()
        self._listeners: list[FaultsListener] = []
        self._revert: asyncio.TimerHandle | None = None
        self.faults = faults or Faults()

    @property
    def faults(self) -> Faults:
        return self._faults

    @faults.setter
    def faults(self, value: Faults) -> None:
        if self._revert is not None:
            self._revert.cancel()
            self._revert = None
        self._faults = value
        self.driver.slowdown = value.slowdown
        for listener in self._listeners:
            listener(value)

    def set_faults_for(self, value: Faults, seconds: float) -> None:
        """Apply ``value`` now and put the current faults back after ``seconds``."""
        previous = self._faults
        self.faults = value

        def revert() -> None:
            self._revert = None
            self.faults = previous

        self._revert = asyncio.get_running_loop().call_later(seconds, revert)

    def engine_stopped(self, task: asyncio.Task[None]) -> None:
        """The engine loop ended: if by a bug, /health turns 503 as vLLM's does."""
        if not task.cancelled() and task.exception() is not None:
            self.engine_dead = True
            log.error("sim_engine_died", exc_info=task.exception())

    def add_faults_listener(self, listener: FaultsListener) -> None:
        """Call ``listener`` with every new faults value (the listener socket uses it)."""
        self._listeners.append(listener)

    def snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot()

    def state_json(self) -> dict[str, object]:
        snap = self.engine.snapshot()
        d = self.driver
        return {
            "model": self.config.model_name,
            "ready": self.ready.is_set(),
            "running": snap.running,
            "waiting": snap.waiting,
            "kv_cache_usage": snap.kv_cache_usage,
            "free_blocks": snap.free_blocks,
            "cached_blocks": snap.cached_blocks,
            "simulated_clock": snap.clock,
            "steps": d.steps,
            "busy_simulated_seconds": d.busy_sim,
            "busy_wall_seconds": d.busy_wall,
            "clock_lag_seconds": d.lag,
            "max_clock_lag_seconds": d.max_lag,
            "in_flight": self.in_flight,
            "audio_bytes": self.audio_bytes,
            "num_preemptions": self.engine.stats.num_preemptions,
            "prefix_cache_queries": self.engine.stats.prefix_cache_queries,
            "prefix_cache_hits": self.engine.stats.prefix_cache_hits,
            "aborted": dict(self.engine.stats.aborted),
            "kv_role": self.config.kv_role,
            "prefills_handed_off": self.prefills_handed_off,
            "kv_transfers": self.engine.stats.kv_transfers,
            "kv_transfer_tokens": self.engine.stats.kv_transfer_tokens,
            "faults": self._faults.to_json(),
            "sleep": self._sleep_json(),
        }

    def _sleep_json(self) -> dict[str, object]:
        report = self.sleep.report()
        state = report.state
        return {
            "is_sleeping": state.is_sleeping,
            "paused": self.engine.pause,
            "level": state.level,
            "asleep": sorted(state.asleep),
            "waking": report.waking,
            "gpu_memory_bytes": report.memory.gpu,
            "cpu_offloaded_bytes": report.memory.cpu_offloaded,
            "operations": list(self.sleep.done),
        }
