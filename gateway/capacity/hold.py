"""Requests held while an engine of their model wakes.

When no engine can take a request for a model because its engines sleep (asleep, waking, or
going to sleep), the request is not refused: it is held (``hold``), counted as demand (so the
manager wakes one: ``wake``, called at once, which asks for a wake through the fleet's log and
calls the engine), and sent as soon as an engine of its model is awake here, or refused with
the usual 503 after the model's ``wake_timeout``. A model none of whose engines sleeps is not
held: the request path answers as it always has.

The pool's change signal wakes the held requests; with none held it costs one test.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Collection

from backends.errors import NoBackendAvailable
from backends.pool import BackendPool
from backends.state import BackendState


class Holds:
    def __init__(
        self,
        pool: BackendPool,
        timeout_of: Callable[[str], float],
        wake: Callable[[str, Collection[str] | None], None],
        *,
        retry_after: int = 1,
        group: Callable[[str, Collection[str] | None], str] = lambda model, _only: model,
    ) -> None:
        self._pool = pool
        self._timeout_of = timeout_of
        self._wake = wake
        self._retry_after = retry_after
        self._group = group  # what a held request counts for: its model, or its model pool
        self._waiters: dict[asyncio.Future[None], tuple[str, Collection[str] | None]] = {}
        self.held: Counter[str] = Counter()  # per model (or pool): held now
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (model, served|timed_out|left)
        pool.on_change(self._changed)

    def _serving(self, model: str, only: Collection[str] | None) -> list[BackendState]:
        """The engines that could serve the request, whatever their rest."""
        return [
            b
            for b in self._pool.serving(model)
            if (only is None or b.id in only) and b.spec.role != "prefill" and b.up
        ]

    def _awake(self, model: str, only: Collection[str] | None) -> bool:
        now = self._pool.now()
        return any(self._pool.routable(b, now) for b in self._serving(model, only))

    async def hold(self, model: str, only: Collection[str] | None = None) -> bool:
        """Wait for an engine of ``model`` (of ``only``, if given) to be awake here: True once
        one is, False at once if none of them sleeps (the caller answers as before). Raises
        ``NoBackendAvailable`` after the model's wake timeout."""
        serving = self._serving(model, only)
        if not any(b.resting for b in serving):
            return False
        if self._awake(model, only):
            return True
        future = asyncio.get_running_loop().create_future()
        self._waiters[future] = (model, only)
        group = self._group(model, only)
        self.held[group] += 1
        self._wake(model, only)
        timeout = self._timeout_of(group)
        try:
            async with asyncio.timeout(timeout):
                await future
        except TimeoutError:
            self.outcomes[model, "timed_out"] += 1
            raise NoBackendAvailable(
                f"No engine serving `{model}` woke within {timeout:g} s.",
                retry_after=self._retry_after,
            ) from None
        except BaseException:
            self.outcomes[model, "left"] += 1
            raise
        finally:
            self._waiters.pop(future, None)
            self.held[group] -= 1
            if not self.held[group]:
                del self.held[group]
        self.outcomes[model, "served"] += 1
        return True

    def _changed(self) -> None:
        if not self._waiters:
            return
        for future, (model, only) in list(self._waiters.items()):
            if not future.done() and self._awake(model, only):
                future.set_result(None)
