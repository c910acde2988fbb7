"""Running a simulator inside a test: ``async with running_sim(config) as sim``.

The simulator binds 127.0.0.1 on port 0 and serves with ``handler_cancellation=True``
like the real runner. ``sim.url`` is its base URL; ``sim.engine``/``sim.state`` give
direct access; ``sim.faults = Faults(...)`` changes faults in-process (use ``await
sim.set_faults(...)`` to also wait for the listening socket when refusing
connections).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from tools.sim.config import SimConfig
from tools.sim.faults import Faults
from tools.sim.runner import SimServer

# Small step costs: a step takes ~1 ms of simulated (and real) time.
FAST: SimConfig = SimConfig(
    step_base_ms=1.0,
    prefill_us_per_token=2.0,
    decode_us_per_seq=5.0,
    attention_ns_per_token=0.0,
)


class RunningSim(SimServer):
    """A simulator started by ``running_sim`` (its URL, engine and faults at hand)."""


@asynccontextmanager
async def running_sim(
    config: SimConfig | None = None, faults: Faults | None = None
) -> AsyncIterator[RunningSim]:
    """A started simulator, stopped on exit."""
    sim = RunningSim(config or FAST, faults=faults)
    await sim.start()
    try:
        yield sim
    finally:
        await sim.stop()
