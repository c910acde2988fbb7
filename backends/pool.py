"""The backend pool: the one place backend state changes, and where snapshots are taken.

The request path calls ``candidates`` then ``acquire``; background monitors call the
``record_*`` methods. Everything runs on one event loop, so there are no locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from backends.state import BackendSpec, BackendState
from backends.vllm_metrics import LoadReading
from gateway.errors import ModelNotFound, NoBackendAvailable
from policies import BackendSnapshot

Clock = Callable[[], float]


class Lease:
    """One request's claim on a backend; ``release`` gives it back exactly once."""

    __slots__ = ("_released", "backend")

    def __init__(self, backend: BackendState) -> None:
        self.backend = backend
        self._released = False
        backend.in_flight += 1
        backend.sent_total += 1

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.backend.in_flight -= 1


class BackendPool:
    def __init__(
        self,
        specs: Iterable[BackendSpec],
        *,
        stale_after: float,
        retry_after: int = 1,
        clock: Clock = time.monotonic,
    ) -> None:
        self._backends: dict[str, BackendState] = {s.id: BackendState(spec=s) for s in specs}
        self._stale_after = stale_after
        self._retry_after = retry_after
        self._clock = clock
        self._by_model: dict[str, list[BackendState]] = {}

    # -- reading ---------------------------------------------------------------------------

    def all(self) -> list[BackendState]:
        return list(self._backends.values())

    def get(self, backend_id: str) -> BackendState:
        return self._backends[backend_id]

    def models(self) -> list[str]:
        """The union of the models the backends were last seen serving."""
        return sorted(self._by_model)

    def routable(self, backend: BackendState) -> bool:
        return backend.reachable and backend.models_known

    def ready(self) -> bool:
        return any(self.routable(b) for b in self._backends.values())

    def snapshot(self, backend: BackendState, now: float) -> BackendSnapshot:
        load = backend.load
        if load is None or now - backend.load_at > self._stale_after:
            return BackendSnapshot(id=backend.id, in_flight=backend.in_flight)
        return BackendSnapshot(
            id=backend.id,
            in_flight=backend.in_flight,
            sent_since_scrape=backend.sent_total - backend.sent_at_scrape,
            queue_depth=load.waiting,
            running=load.running,
            kv_cache_usage=load.kv_cache_usage,
        )

    def candidates(self, model: str) -> list[BackendSnapshot]:
        """Snapshots of the routable backends serving ``model``.

        Raises ``ModelNotFound`` if no backend serves it, ``NoBackendAvailable`` if those that
        do cannot take a request now.
        """
        serving = self._by_model.get(model)
        if not serving:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        now = self._clock()
        snaps = [self.snapshot(b, now) for b in serving if self.routable(b)]
        if not snaps:
            raise NoBackendAvailable(
                f"No backend serving `{model}` is available right now.",
                retry_after=self._retry_after,
            )
        return snaps

    def acquire(self, backend_id: str) -> Lease:
        return Lease(self._backends[backend_id])

    # -- writing (monitors) ----------------------------------------------------------------

    def record_models(self, backend_id: str, models: Iterable[str]) -> None:
        b = self._backends[backend_id]
        b.models = frozenset(models)
        b.models_known = True
        b.reachable = True
        self._reindex()

    def record_unreachable(self, backend_id: str) -> None:
        self._backends[backend_id].reachable = False

    def record_load(
        self, backend_id: str, reading: LoadReading, *, began_at: float, sent_at_start: int
    ) -> None:
        b = self._backends[backend_id]
        b.load = reading
        b.load_at = began_at
        b.sent_at_scrape = sent_at_start

    def _reindex(self) -> None:
        by_model: dict[str, list[BackendState]] = {}
        for b in self._backends.values():
            for m in b.models:
                by_model.setdefault(m, []).append(b)
        self._by_model = by_model
