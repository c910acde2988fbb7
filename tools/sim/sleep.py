"""Sleep mode as vLLM 0.32 has it (``VLLM_SERVER_DEV_MODE=1``): the state machine. Pure.

vLLM's engine core keeps two things that sleep mode changes, and so does ``Sleep``:

- the scheduler's pause: ``sleep`` pauses it at every level (mode ``keep`` stops everything,
  ``abort`` and ``wait`` stop admitting requests, after aborting them all or letting the
  running ones finish); requests sent meanwhile are queued, not refused.
- the executor's memory, tagged ``weights`` and ``kv_cache``: level 1 offloads the weights
  to CPU memory and discards the KV cache (and with it the prefix cache), level 2 discards
  both. Level 0 leaves the memory alone. An executor already asleep stays as it is.

``wake_up`` wakes the executor's tags asked for (all of them without tags; ``scheduling`` is
not an executor tag and wakes nothing by itself; a tag that is not asleep makes vLLM wake
nothing at all), then resumes scheduling only once no tag is left asleep. ``is_sleeping`` is
vLLM's: the scheduler paused, or any memory asleep.

The gauge ``vllm:engine_sleep_state`` shows what vLLM's stat logger last recorded, not the
engine's state: ``sleep`` records ``(1, level)`` once it is done, so level 0 sets all three
series to 0, and every ``wake_up`` records ``(0, 0)``, ``awake`` 1, even a partial one.

GPU memory (the simulator's own model, for plots of what sleeping frees): the weights take
``gpu_memory_gib`` and the KV cache ``num_gpu_blocks_override x block_size x
kv_cache_kib_per_token``, both allocated whole from start-up as vLLM does; a tag asleep takes
no GPU memory, and level 1's offloaded weights take as much CPU memory. Waking the weights
takes ``wake_time`` (level 1: copied back from CPU memory) or ``wake_time_level2`` (level 2:
loaded again); reallocating the KV cache is free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Final, Literal, cast

from tools.sim.config import SimConfig
from tools.sim.validation import Fields, Problems

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: Final[tuple[PauseMode, ...]] = ("abort", "wait", "keep")
MAX_LEVEL: Final = 2
ALL_TAGS: Final = frozenset({"weights", "kv_cache"})
SCHEDULING: Final = "scheduling"  # a wake_up tag that names the scheduler, not memory
SLEEP_STATES: Final = ("awake", "weights_offloaded", "discard_all")
GIB: Final = 1024**3


@dataclass(frozen=True, slots=True)
class SleepRequest:
    """``POST /sleep``'s query, validated."""

    level: int = 1
    mode: PauseMode = "abort"


def parse_sleep(query: Mapping[str, str]) -> SleepRequest:
    """``level`` (0, 1 or 2; default 1) and ``mode`` (``abort``, ``wait``, ``keep``; default
    ``abort``), as vLLM's router declares them; anything else is its validation 400
    (``validation.BodyError``, ``param`` e.g. ``query.level``)."""
    problems = Problems()
    fields = Fields(dict(query), ("query",), problems)
    level = fields.integer("level")
    if level is not None and not 0 <= level <= MAX_LEVEL:
        kind, bound = ("greater_than_equal", 0) if level < 0 else ("less_than_equal", MAX_LEVEL)
        words = "greater than or equal to" if level < 0 else "less than or equal to"
        ctx = {"ge" if level < 0 else "le": bound}
        fields.error("level", kind, f"Input should be {words} {bound}", query["level"], **ctx)
    mode = fields.literal("mode", PAUSE_MODES)
    problems.check()
    default = SleepRequest()
    return SleepRequest(
        level=default.level if level is None else level,
        mode=default.mode if mode is None else cast(PauseMode, mode),
    )


def parse_tags(values: Sequence[str]) -> frozenset[str] | None:
    """``POST /wake_up``'s repeated ``tags``: None (wake everything) when there are none."""
    return frozenset(values) if values else None


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """Bytes in use: on the GPU (weights, KV cache) and, offloaded there, in CPU memory."""

    weights: int
    kv_cache: int
    cpu_offloaded: int

    @property
    def gpu(self) -> int:
        return self.weights + self.kv_cache


@dataclass(frozen=True, slots=True)
class Sleep:
    """Where sleep mode stands: a value, replaced by each operation."""

    paused: bool = False  # the scheduler, by a sleep not yet undone
    level: int = 0  # the level the executor slept at (1, 2); 0 while none of its memory is
    asleep: frozenset[str] = frozenset()  # the executor's tags not on the GPU now
    recorded: tuple[int, int] = (0, 0)  # vLLM's record_sleep_state(sleep, level), last call

    @property
    def is_sleeping(self) -> bool:
        """``GET /is_sleeping``: the scheduler paused or any memory asleep."""
        return self.paused or bool(self.asleep)

    def pausing(self) -> Sleep:
        """A sleep has begun: the scheduler is paused from now on."""
        return replace(self, paused=True)

    def slept(self, level: int) -> Sleep:
        """A sleep at ``level`` is done (in-flight requests dealt with): the executor sleeps
        at levels 1 and 2 unless it already does, and the gauge records the level asked."""
        if level >= 1 and not self.asleep:
            return replace(self, paused=True, level=level, asleep=ALL_TAGS, recorded=(1, level))
        return replace(self, paused=True, recorded=(1, level))

    def wake(self, tags: frozenset[str] | None, config: SimConfig) -> Wake:
        """What ``wake_up`` with these tags does (None: everything)."""
        wanted = self.asleep if tags is None else tags - {SCHEDULING}
        woken: frozenset[str] = frozenset()
        if self.asleep and (tags is None or wanted) and wanted <= self.asleep:
            woken = wanted  # vLLM wakes nothing if any tag asked for is not asleep
        left = self.asleep - woken
        seconds = 0.0
        if "weights" in woken:
            seconds = config.wake_time if self.level == 1 else config.wake_time_level2
        after = Sleep(
            paused=self.paused and bool(left),
            level=self.level if left else 0,
            asleep=left,
            recorded=(0, 0),
        )
        return Wake(woken, seconds, after)

    def gauge(self) -> dict[str, int]:
        """``vllm:engine_sleep_state`` by ``sleep_state``, from what was last recorded."""
        sleeping, level = self.recorded
        return {
            "awake": 0 if sleeping else 1,
            "weights_offloaded": 1 if sleeping and level == 1 else 0,
            "discard_all": 1 if sleeping and level == MAX_LEVEL else 0,
        }

    def memory(self, config: SimConfig) -> GpuMemory:
        """The memory in use now (see the module docstring's model)."""
        weights = round(config.gpu_memory_gib * GIB)
        tokens = config.num_gpu_blocks_override * config.block_size
        kv_cache = round(tokens * config.kv_cache_kib_per_token * 1024)
        offloaded = "weights" in self.asleep
        return GpuMemory(
            weights=0 if offloaded else weights,
            kv_cache=0 if "kv_cache" in self.asleep else kv_cache,
            cpu_offloaded=weights if offloaded and self.level == 1 else 0,
        )


@dataclass(frozen=True, slots=True)
class Wake:
    """A ``wake_up``'s plan: the tags it wakes, how long that takes, the state after."""

    woken: frozenset[str]
    seconds: float
    after: Sleep
