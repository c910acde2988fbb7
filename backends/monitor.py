"""Background reads of each backend: its model list (``/v1/models``) and load (``/metrics``).

One task per backend and per kind, so a slow backend delays only its own figures. Results go
into the pool; the request path never waits on any of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from backends.pool import BackendPool
from backends.state import BackendState
from backends.upstream import UpstreamClient, json_or_none
from backends.vllm_metrics import MetricsFormatError, parse_load
from gateway.errors import UpstreamError

log = structlog.get_logger("backends.monitor")


@dataclass(frozen=True, slots=True)
class MonitorSettings:
    scrape_interval: float
    scrape_timeout: float
    models_interval: float


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
        client: UpstreamClient,
        settings: MonitorSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._client = client
        self._settings = settings
        self._clock = clock
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, *, first_round_timeout: float = 2.0) -> None:
        """Read every backend's models once (bounded wait), then keep reading in the background."""
        backends = self._pool.all()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(first_round_timeout):
                await asyncio.gather(*(self.refresh_models(b) for b in backends))
        for b in backends:
            if not b.reachable:
                log.warning("backend_unreachable", backend=b.id, reason="no model list yet")
        for b in backends:
            self._tasks.append(asyncio.create_task(self._models_loop(b), name=f"models:{b.id}"))
            self._tasks.append(asyncio.create_task(self._load_loop(b), name=f"scrape:{b.id}"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def refresh_models(self, backend: BackendState) -> bool:
        try:
            status, raw = await self._client.get(
                backend.spec, "/v1/models", within=self._settings.scrape_timeout
            )
        except UpstreamError as exc:
            self._mark_unreachable(backend, exc.message)
            return False
        models = parse_model_list(raw) if status == 200 else None
        if models is None:
            self._mark_unreachable(backend, f"/v1/models answered {status} without a model list")
            return False
        if not backend.reachable or backend.models != frozenset(models):
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
                return False
            reading = parse_load(raw.decode("utf-8", "replace"))
        except (UpstreamError, MetricsFormatError):
            return False
        self._pool.record_load(backend.id, reading, began_at=began_at, sent_at_start=sent_at_start)
        return True

    def _mark_unreachable(self, backend: BackendState, why: str) -> None:
        if backend.reachable:
            log.warning("backend_unreachable", backend=backend.id, reason=why)
        self._pool.record_unreachable(backend.id)

    async def _models_loop(self, backend: BackendState) -> None:
        while True:
            # A backend whose models are unknown is retried at the scrape pace.
            fast = not (backend.reachable and backend.models_known)
            await asyncio.sleep(
                self._settings.scrape_interval if fast else self._settings.models_interval
            )
            await self.refresh_models(backend)

    async def _load_loop(self, backend: BackendState) -> None:
        interval = self._settings.scrape_interval
        while True:
            started = self._clock()
            await self.scrape_load(backend)
            await asyncio.sleep(max(0.0, interval - (self._clock() - started)))
