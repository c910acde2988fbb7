"""Background loops that never end silently: a crash is logged, counted and restarted.

Every long-lived task of the gateway (health probes, scrapes, model lists, DNS discovery, the
idle watchdog, the limit store's backlog) is started through one ``Supervisor``. A loop that
raises is logged with its traceback (``background_task_failed``), counted by kind (the
``llm_gateway_background_task_restarts_total`` metric), and started again after a backoff
that doubles with each crash in a row (a loop that ran longer than the cap between two crashes
starts the count again). Routing never runs on figures frozen by a dead loop unnoticed.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger("backends.supervise")

Loop = Callable[[], Awaitable[None]]


class Supervisor:
    """Starts loops as tasks and restarts them when they crash; ``restarts`` counts by kind."""

    def __init__(
        self,
        *,
        backoff_base: float = 0.1,
        backoff_max: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self._clock = clock
        self.restarts: Counter[str] = Counter()

    def spawn(self, kind: str, name: str, loop: Loop) -> asyncio.Task[None]:
        """Run ``loop()`` as a task named ``name``; ``kind`` is the metric's label (bounded)."""
        return asyncio.create_task(self._run(kind, name, loop), name=name)

    async def _run(self, kind: str, name: str, loop: Loop) -> None:
        crashes = 0
        while True:
            started = self._clock()
            try:
                await loop()
                return  # a loop that returns has finished its work
            except Exception:
                crashes = 1 if self._clock() - started > self.backoff_max else crashes + 1
                wait = min(self.backoff_max, self.backoff_base * 2 ** (crashes - 1))
                self.restarts[kind] += 1
                log.exception("background_task_failed", task=name, kind=kind, restart_in_s=wait)
                await asyncio.sleep(wait)
