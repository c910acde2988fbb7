"""Background reads of each backend: health probes, model lists and load figures.

Per backend, three loops: ``GET /health`` every probe interval (with its own timeout, so a
backend that accepts connections but never answers is caught), ``GET /v1/models`` now and then,
and ``GET /metrics`` on a short interval; with ``sleep_probe`` (the capacity manager on), a
fourth: ``GET /is_sleeping`` every probe interval, and every ``sleep_poll`` while the engine is
going to sleep or waking (a request held for a wake goes as soon as the engine is awake).
Without it, vLLM's ``vllm:engine_sleep_state`` gauge in the scrape says whether it sleeps.
Results go into the pool; the request path never waits on any of this. Backends can be
watched and unwatched at run time (discovery).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

import structlog

from backends.errors import UpstreamError
from backends.health import Health
from backends.pool import BackendPool
from backends.sleep import Rest
from backends.state import BackendSpec, BackendState
from backends.supervise import Supervisor
from backends.upstream.client import json_or_none
from backends.vllm_metrics import MetricsFormatError, parse_load

log = structlog.get_logger("backends.monitor")

# What the monitor reads of each backend: its health, its models and its load figures.
READ_PATHS: Final = ("/health", "/v1/models", "/metrics")


class Reader(Protocol):
    """How the monitor reads a backend (``Transport.get``, or reads shared by the workers of
    a host: ``gateway.workers.shared_reads``)."""

    async def get(self, backend: BackendSpec, path: str, *, within: float) -> tuple[int, bytes]: ...


@dataclass(frozen=True, slots=True)
class MonitorSettings:
    scrape_interval: float
    scrape_timeout: float
    models_interval: float
    probe_interval: float
    probe_timeout: float
    sleep_probe: bool = False
    sleep_poll: float = 0.25


def parse_model_list(raw: bytes) -> list[str] | None:
    """Model ids from an OpenAI ``/v1/models`` answer, or ``None`` if it is not one."""
    doc = json_or_none(raw)
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        return None
    ids = [m.get("id") for m in doc["data"] if isinstance(m, dict)]
    if not ids or not all(isinstance(i, str) and i for i in ids):
        return None
    return [str(i) for i in ids]


class BackendMonitor:
    def __init__(
        self,
        pool: BackendPool,
        client: Reader,
        settings: MonitorSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        supervisor: Supervisor | None = None,
    ) -> None:
        self._supervisor = supervisor or Supervisor()
        self._pool = pool
        self._client = client
        self._settings = settings
        self._clock = clock
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}

    async def start(self, *, first_round_timeout: float = 2.0) -> None:
        """Probe every backend once (bounded wait), then keep watching in the background."""
        backends = self._pool.all()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(first_round_timeout):
                await asyncio.gather(*(self._first_look(b) for b in backends))
        for b in backends:
            self.watch(b)

    async def stop(self) -> None:
        tasks = [t for ts in self._tasks.values() for t in ts]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    def watch(self, backend: BackendState) -> None:
        if backend.id in self._tasks:
            return
        spawn = self._supervisor.spawn
        self._tasks[backend.id] = [
            spawn("probe", f"probe:{backend.id}", lambda: self._probe_loop(backend)),
            spawn("models", f"models:{backend.id}", lambda: self._models_loop(backend)),
            spawn("scrape", f"scrape:{backend.id}", lambda: self._load_loop(backend)),
        ]
        if self._settings.sleep_probe:
            self._tasks[backend.id].append(
                spawn("sleep", f"sleep:{backend.id}", lambda: self._sleep_loop(backend))
            )

    def unwatch(self, backend_id: str) -> None:
        for t in self._tasks.pop(backend_id, []):
            t.cancel()

    def watching(self) -> set[str]:
        return set(self._tasks)

    async def _first_look(self, backend: BackendState) -> None:
        if await self.probe(backend):
            await self.refresh_models(backend)
            if self._settings.sleep_probe:
                await self.read_sleep(backend)

    async def read_sleep(self, backend: BackendState) -> bool | None:
        """Ask the engine whether it sleeps (vLLM's dev-mode ``GET /is_sleeping``) and record
        it; None if it cannot say (no such route: not in dev mode, or not vLLM)."""
        try:
            status, raw = await self._client.get(
                backend.spec, "/is_sleeping", within=self._settings.probe_timeout
            )
        except UpstreamError:
            return backend.asleep  # unreachable: its health says so; its sleep is unchanged
        doc = json_or_none(raw) if status == 200 else None
        asleep = doc.get("is_sleeping") if isinstance(doc, dict) else None
        if not isinstance(asleep, bool):
            if backend.asleep is not None or status != 404:
                log.warning("backend_sleep_unreadable", backend=backend.id, status=status)
            asleep = None
        if self._pool.record_asleep(backend.id, asleep):
            log.info("backend_sleep", backend=backend.id, asleep=asleep, rest=backend.rest.value)
        return asleep

    async def probe(self, backend: BackendState) -> bool:
        try:
            status, _ = await self._client.get(
                backend.spec, "/health", within=self._settings.probe_timeout
            )
            ok, error = status == 200, f"/health answered {status}"
        except UpstreamError as exc:
            ok, error = False, exc.message
        before, after = self._pool.record_probe(backend.id, ok, "" if ok else error)
        if before is not after:
            emit = log.info if after is Health.UP else log.warning
            emit(
                "backend_health",
                backend=backend.id,
                state=after.value,
                was=before.value,
                reason=None if ok else error,
            )
        return ok

    async def refresh_models(self, backend: BackendState) -> bool:
        try:
            status, raw = await self._client.get(
                backend.spec, "/v1/models", within=self._settings.scrape_timeout
            )
        except UpstreamError:
            return False
        models = parse_model_list(raw) if status == 200 else None
        if models is None:
            log.warning("backend_models_unreadable", backend=backend.id, status=status)
            return False
        if not backend.models_known or backend.models != frozenset(models):
            log.info("backend_models", backend=backend.id, models=models)
        self._pool.record_models(backend.id, models)
        return True

    async def scrape_load(self, backend: BackendState) -> bool:
        began_at = self._clock()
        sent_at_start = backend.sent_total
        try:
            status, raw = await self._client.get(
                backend.spec, "/metrics", within=self._settings.scrape_timeout
            )
            if status != 200:
                raise MetricsFormatError(f"/metrics answered {status}")
            reading = parse_load(raw.decode("utf-8", "replace"))
        except (UpstreamError, MetricsFormatError):
            self._pool.record_scrape_failed(backend.id)
            return False
        self._pool.record_load(backend.id, reading, began_at=began_at, sent_at_start=sent_at_start)
        if not self._settings.sleep_probe and reading.asleep is not backend.asleep:
            self._pool.record_asleep(backend.id, reading.asleep)
            log.info("backend_sleep", backend=backend.id, asleep=reading.asleep, source="gauge")
        return True

    async def _probe_loop(self, backend: BackendState) -> None:
        interval = self._settings.probe_interval
        await asyncio.sleep(interval)
        while True:
            started = self._clock()
            was_up = backend.up
            if await self.probe(backend) and not was_up:
                await self.refresh_models(backend)
            await asyncio.sleep(max(0.0, interval - (self._clock() - started)))

    async def _models_loop(self, backend: BackendState) -> None:
        while True:
            # Until its models are known, a backend is asked at the probe pace.
            known = backend.models_known
            await asyncio.sleep(
                self._settings.models_interval if known else self._settings.probe_interval
            )
            if backend.up or not known:
                await self.refresh_models(backend)

    async def _sleep_loop(self, backend: BackendState) -> None:
        settings = self._settings
        while True:
            moving = backend.rest in (Rest.WAKING, Rest.GOING_TO_SLEEP)
            await asyncio.sleep(settings.sleep_poll if moving else settings.probe_interval)
            if backend.up:
                await self.read_sleep(backend)

    async def _load_loop(self, backend: BackendState) -> None:
        interval = self._settings.scrape_interval
        while True:
            started = self._clock()
            await self.scrape_load(backend)
            await asyncio.sleep(max(0.0, interval - (self._clock() - started)))
