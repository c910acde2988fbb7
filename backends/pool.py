"""The backend pool: the one place backend state changes, and where snapshots are taken.

The request path calls ``candidates`` then ``acquire``, and reports each attempt's outcome on
its ``Lease``; background monitors and discovery call the ``record_*``, ``add`` and ``remove``
methods. Everything runs on one event loop, so there are no locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable

import structlog

from backends.circuit import Circuit, CircuitBreaker, CircuitPolicy
from backends.errors import EndpointNotServed, ModelNotFound, NoBackendAvailable
from backends.health import Health, HealthPolicy, HealthTracker
from backends.shared_inflight import SharedInFlight
from backends.sleep import Rest, rest_of
from backends.state import BackendSpec, BackendState
from backends.vllm_metrics import LoadReading
from policies import BackendSnapshot

Clock = Callable[[], float]
log = structlog.get_logger("backends.pool")


class Lease:
    """One attempt's claim on a backend.

    The request path reports ``succeeded`` or ``failed`` (for the circuit breaker) and must
    ``release``; release is idempotent, so the in-flight count drops exactly once.
    """

    __slots__ = ("_down", "_pool", "_released", "_verdict", "backend")

    def __init__(self, pool: BackendPool, backend: BackendState) -> None:
        self._pool = pool
        self.backend = backend
        self._released = False
        self._verdict: bool | None = None
        self._down: Callable[[], None] | None = None
        backend.in_flight += 1
        backend.sent_total += 1
        if pool.shared is not None:
            pool.shared.set(backend.id, backend.in_flight)

    def on_down(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` if the backend's probes mark it down while this lease is held
        (None: no longer). The request path sets it while nothing has reached the client,
        so a request waiting on a dead backend moves on at once."""
        watchers = self.backend.down_watchers
        if self._down is not None:
            watchers.discard(self._down)
        self._down = callback
        if callback is not None and not self._released:
            watchers.add(callback)

    @property
    def released(self) -> bool:
        return self._released

    def succeeded(self) -> None:
        if self._verdict is None:
            self._verdict = True
            self.backend.circuit.on_success()

    def failed(self) -> None:
        if self._verdict is None:
            self._verdict = False
            before = self.backend.circuit.state
            self.backend.circuit.on_failure(self._pool.now())
            if before is not Circuit.OPEN and self.backend.circuit.state is Circuit.OPEN:
                log.warning(
                    "circuit_opened",
                    backend=self.backend.id,
                    cooldown_s=self.backend.circuit.current_cooldown,
                )

    def release(self) -> None:
        if self._released:
            return
        self.on_down(None)
        self._released = True
        if self._verdict is None:
            self.backend.circuit.on_abandoned()
        self.backend.in_flight -= 1
        shared = self._pool.shared
        if shared is not None:
            shared.set(self.backend.id, self.backend.in_flight)
        if self.backend.removed and self.backend.in_flight == 0:
            self._pool.forget(self.backend.id)
        self._pool.changed()


class BackendPool:
    def __init__(
        self,
        specs: Iterable[BackendSpec],
        *,
        stale_after: float,
        retry_after: int = 1,
        health: HealthPolicy | None = None,
        circuit: CircuitPolicy | None = None,
        clock: Clock = time.monotonic,
        shared: SharedInFlight | None = None,
    ) -> None:
        # With several worker processes (``serve --workers``): the host's in-flight counts,
        # this process's written there and the others' added to every snapshot.
        self.shared = shared
        self._stale_after = stale_after
        self._retry_after = retry_after
        self._health_policy = health or HealthPolicy()
        self._circuit_policy = circuit or CircuitPolicy()
        self._clock = clock
        self._backends: dict[str, BackendState] = {}
        self._by_model: dict[str, list[BackendState]] = {}
        self._lacking = 0  # backends that lack some endpoint: 0 spares the filter below
        self._roles: dict[str, frozenset[str]] = {}  # model -> roles of backends serving it
        self._listeners: list[Callable[[], None]] = []
        for spec in specs:
            self.add(spec)

    def now(self) -> float:
        return self._clock()

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever the fleet's capacity may have changed: a request ended,
        a scrape arrived, health, models, draining or membership changed (the admission
        queue wakes its next waiter on it). Listeners must be cheap and must not raise."""
        self._listeners.append(listener)

    def changed(self) -> None:
        for listener in self._listeners:
            listener()

    # -- reading ---------------------------------------------------------------------------

    def all(self) -> list[BackendState]:
        return list(self._backends.values())

    def get(self, backend_id: str) -> BackendState | None:
        return self._backends.get(backend_id)

    def models(self) -> list[str]:
        """The union of the models the backends were last seen serving."""
        return sorted(self._by_model)

    def serves(self, model: str) -> bool:
        """Whether some backend was last seen serving ``model`` (healthy or not)."""
        return model in self._by_model

    def routable(self, backend: BackendState, now: float) -> bool:
        return (
            backend.health.state is Health.UP
            and backend.models_known
            and not backend.draining
            and not backend.resting
            and not backend.removed
            and backend.circuit.allows(now)
        )

    def ready(self) -> bool:
        now = self._clock()
        return any(self.routable(b, now) for b in self._backends.values())

    def in_flight(self, backend: BackendState) -> int:
        """Requests in flight to ``backend`` from this host: this process's, and its other
        workers' when there are some."""
        if self.shared is None:
            return backend.in_flight
        return backend.in_flight + self.shared.others(backend.id)

    def snapshot(self, backend: BackendState, now: float) -> BackendSnapshot:
        load = backend.load
        in_flight = self.in_flight(backend)
        if load is None or now - backend.load_at > self._stale_after:
            return BackendSnapshot(id=backend.id, in_flight=in_flight)
        return BackendSnapshot(
            id=backend.id,
            in_flight=in_flight,
            # Sent after the scrape began and, at most, still in flight: a finished request
            # is in no queue, whatever the last scrape says.
            sent_since_scrape=min(backend.sent_total - backend.sent_at_scrape, backend.in_flight),
            queue_depth=load.waiting,
            running=load.running,
            kv_cache_usage=load.kv_cache_usage,
        )

    def any_routable(self, model: str, only: Collection[str]) -> bool:
        """Whether one of the backends ``only`` serving ``model`` can take a request now."""
        now = self._clock()
        return any(
            b.id in only and b.spec.role != "prefill" and self.routable(b, now)
            for b in self._by_model.get(model, ())
        )

    def roles(self, model: str) -> frozenset[str]:
        """The roles (``both``, ``prefill``, ``decode``) of the backends serving ``model``."""
        return self._roles.get(model, frozenset())

    def candidates(
        self,
        model: str,
        exclude: Collection[str] = (),
        role: str | None = None,
        only: Collection[str] | None = None,
        endpoint: str | None = None,
    ) -> list[BackendSnapshot]:
        """Snapshots of the routable backends serving ``model``, less ``exclude``.

        ``only``: if given, just these backends (a model pool's, ``gateway.request.rollout``).
        ``endpoint``: if given, not the backends known to lack it (``record_lacks``).

        ``role`` None: every backend but prefill-only ones (normal routing); otherwise only
        the backends of that role (the steps of a disaggregated request).
        Raises ``ModelNotFound`` if no backend serves it, ``EndpointNotServed`` if every one
        that does lacks the endpoint, ``NoBackendAvailable`` if those left cannot take a
        request now.
        """
        serving = self._by_model.get(model)
        if not serving:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        if endpoint is not None and self._lacking:
            serving = [b for b in serving if endpoint not in b.lacks]
            if not serving:
                raise EndpointNotServed(
                    f"No backend serving `{model}` offers the {endpoint} endpoint (vLLM serves "
                    "generation with --runner generate, embeddings, pooling, scoring and "
                    "reranking with --runner pooling).",
                    param="model",
                )
        now = self._clock()
        snaps = [
            self.snapshot(b, now)
            for b in serving
            if b.id not in exclude
            and (only is None or b.id in only)
            and (b.spec.role != "prefill" if role is None else b.spec.role == role)
            and self.routable(b, now)
        ]
        if not snaps:
            raise NoBackendAvailable(
                f"No backend serving `{model}` is available right now.",
                retry_after=self._retry_after,
            )
        return snaps

    def acquire(self, backend_id: str) -> Lease:
        backend = self._backends[backend_id]
        backend.circuit.on_send(self._clock())
        return Lease(self, backend)

    # -- writing (monitors, discovery, admin) ----------------------------------------------

    def add(self, spec: BackendSpec) -> BackendState:
        """Add a backend; it gets no traffic until a probe has seen it up.

        Adding an id the pool has takes the new spec. A new URL is another server: what was
        known of the old one (health, circuit, load, models) is forgotten, so it gets no
        traffic until probed; requests in flight to the old one finish there.
        """
        existing = self._backends.get(spec.id)
        if existing is not None:
            existing.removed = False
            if existing.spec != spec:
                self._respec(existing, spec)
            return existing
        state = BackendState(
            spec=spec,
            health=HealthTracker(self._health_policy),
            circuit=CircuitBreaker(self._circuit_policy),
        )
        self._backends[spec.id] = state
        return state

    def _respec(self, b: BackendState, spec: BackendSpec) -> None:
        old = b.spec
        b.spec = spec
        if spec.url != old.url:
            b.health = HealthTracker(self._health_policy)
            b.circuit = CircuitBreaker(self._circuit_policy)
            b.load, b.load_at, b.scrape_failing = None, float("-inf"), False
            b.models, b.models_known = frozenset(), False
            b.asleep = None  # another server: its sleep not known yet
            b.resting = b.sleep_wanted
            self._forget_lacks(b)
        log.info(
            "backend_changed",
            backend=spec.id,
            url=spec.url,
            was=old.url,
            role=spec.role,
            api_key_changed=spec.api_key != old.api_key,
        )
        self._reindex()

    def remove(self, backend_id: str) -> None:
        """No new requests; the backend is forgotten once its in-flight requests end."""
        b = self._backends.get(backend_id)
        if b is None:
            return
        b.removed = True
        if b.in_flight == 0:
            self.forget(backend_id)

    def forget(self, backend_id: str) -> None:
        b = self._backends.pop(backend_id, None)
        if b is not None:
            self._lacking -= bool(b.lacks)
            self._reindex()

    def set_draining(self, backend_id: str, draining: bool) -> bool:
        b = self._backends.get(backend_id)
        if b is None:
            return False
        b.draining = draining
        self.changed()
        return True

    def set_sleep_wanted(self, backend_id: str, wanted: bool) -> bool:
        """The fleet wants the backend asleep (no new requests from now), or awake again."""
        b = self._backends.get(backend_id)
        if b is None:
            return False
        was = b.rest
        b.sleep_wanted = wanted
        self._rested(b, was)
        return True

    def record_asleep(self, backend_id: str, asleep: bool | None) -> bool:
        """What the backend says of its sleep (None: it cannot say); True if that changed."""
        b = self._backends.get(backend_id)
        if b is None or b.asleep is asleep:
            return False
        was = b.rest
        b.asleep = asleep
        self._rested(b, was)
        return True

    def _rested(self, b: BackendState, was: Rest) -> None:
        b.resting = b.sleep_wanted or bool(b.asleep)
        rest = rest_of(b.sleep_wanted, b.asleep)
        if rest is not was:
            b.rest_since = self._clock()
            if b.asleep and b.in_flight:
                # Requests sent to it before this replica knew it was to sleep: those with
                # nothing sent to their client yet go elsewhere (as from a backend gone down)
                for callback in list(b.down_watchers):
                    callback()
        self.changed()

    def serving(self, model: str) -> list[BackendState]:
        """The backends last seen serving ``model`` (whatever their state)."""
        return list(self._by_model.get(model, ()))

    def record_models(self, backend_id: str, models: Iterable[str]) -> None:
        b = self._backends.get(backend_id)
        if b is None:
            return
        new = frozenset(models)
        changed = not b.models_known or new != b.models
        b.models = new
        b.models_known = True
        if changed:
            self._forget_lacks(b)
            self._reindex()

    def record_lacks(self, backend_id: str, endpoint: str) -> None:
        """The backend answered ``endpoint`` with "no such route": send it no more of those."""
        b = self._backends.get(backend_id)
        if b is None or endpoint in b.lacks:
            return
        b.lacks = b.lacks | {endpoint}
        self._lacking += b.lacks == {endpoint}
        log.info("backend_lacks_endpoint", backend=backend_id, endpoint=endpoint)

    def _forget_lacks(self, b: BackendState) -> None:
        if b.lacks:
            b.lacks = frozenset()
            self._lacking -= 1

    def record_probe(self, backend_id: str, ok: bool, error: str = "") -> tuple[Health, Health]:
        """Feed one health probe's result; return the state before and after."""
        b = self._backends.get(backend_id)
        if b is None:
            return Health.UNKNOWN, Health.UNKNOWN
        before = b.health.state
        stale = self._clock() - b.load_at > self._stale_after
        if ok:
            after = b.health.probe_ok()
        else:
            after = b.health.probe_failed(error, scrape_failing=b.scrape_failing or stale)
        if after is not before:
            if after is Health.DOWN:
                for callback in list(b.down_watchers):
                    callback()
            elif after is Health.UP:
                self._forget_lacks(b)  # back, perhaps restarted as the other kind of server
            self.changed()
        return before, after

    def record_stall(self, backend_id: str, error: str) -> bool:
        """Take a backend whose streams all stopped moving out of rotation, as failed probes
        would (requests waiting on it are told), and open its circuit: its probes bring it
        back, and then one trial request after the circuit's cooldown (growing while it keeps
        stalling: a hung engine's ``/health`` may well answer). True if it was not down."""
        b = self._backends.get(backend_id)
        if b is None or b.health.state is Health.DOWN:
            return False
        b.health.mark_down(error)
        b.circuit.trip(self._clock())
        for callback in list(b.down_watchers):
            callback()
        self.changed()
        return True

    def record_load(
        self, backend_id: str, reading: LoadReading, *, began_at: float, sent_at_start: int
    ) -> None:
        b = self._backends.get(backend_id)
        if b is None:
            return
        b.load = reading
        b.load_at = began_at
        b.sent_at_scrape = sent_at_start
        b.scrape_failing = False
        self.changed()

    def record_scrape_failed(self, backend_id: str) -> None:
        b = self._backends.get(backend_id)
        if b is not None:
            b.scrape_failing = True

    def _reindex(self) -> None:
        by_model: dict[str, list[BackendState]] = {}
        for b in self._backends.values():
            for m in b.models:
                by_model.setdefault(m, []).append(b)
        self._by_model = by_model
        self._roles = {m: frozenset(b.spec.role for b in bs) for m, bs in by_model.items()}
        self.changed()
