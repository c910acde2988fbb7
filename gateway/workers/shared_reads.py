"""With ``serve --workers``, each backend's health, model list and load figures read once per
host, not once per worker.

Every worker runs the same monitor loops (``backends.monitor``), so each keeps its own view and
its own health state machine, but only worker 0 sends the reads to the backends: it keeps the
latest answer to each (``ReadCache``), and the other workers ask it for that on its private
socket (``GET /backend-read``) instead of asking the backend. A reading older than twice its
loop's interval is not taken (worker 0 is behind, or no longer reads that backend); then, and
whenever worker 0 cannot be asked (it died and is being started again), a worker reads the
backend itself. N workers cost each engine one scrape and one probe per interval, as one
gateway does; ``llm_gateway_monitor_reads_total`` says by whom each read was answered.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import urlencode

from aiohttp import web
from aiohttp.typedefs import Handler

from backends.errors import UpstreamError, UpstreamUnreachable
from backends.monitor import READ_PATHS
from backends.state import BackendSpec
from backends.upstream.client import Transport
from gateway.workers.supervisor import ask_peer

READ_PATH: Final = "/backend-read"  # on worker 0's private socket: ?url=<backend>&path=<read>
_ASK_WITHIN_S: Final = 0.5
_MAX_ENTRIES: Final = 3 * 4096  # the three reads of as many backends as discovery may bring


@dataclass(frozen=True, slots=True)
class Reading:
    at: float  # when worker 0's read ended (time.monotonic: one clock for the whole host)
    status: int
    body: bytes
    error: str | None = None  # the read failed: this is why (``status`` and ``body`` unused)


class ReadCache:
    """Worker 0's latest reading of each (backend, path)."""

    def __init__(self) -> None:
        self._readings: dict[tuple[str, str], Reading] = {}

    def put(self, url: str, path: str, reading: Reading) -> None:
        self._readings[(url, path)] = reading
        if len(self._readings) > _MAX_ENTRIES:  # backends gone (discovery): the oldest go
            oldest = sorted(self._readings.items(), key=lambda kv: kv[1].at)
            for key, _ in oldest[: len(oldest) // 2]:
                del self._readings[key]

    def get(self, url: str, path: str) -> Reading | None:
        return self._readings.get((url, path))


class SharedReads:
    """The monitor's reads for one worker: worker 0 reads the backends and keeps what it read;
    the others take that from it while it is fresh, and read the backends themselves when not."""

    def __init__(
        self,
        client: Transport,
        cache: ReadCache,
        leader: Path | None,
        max_age: dict[str, float],
        count: Callable[[str, str], None] = lambda path, source: None,
    ) -> None:
        """``leader``: worker 0's private socket, or None in worker 0 itself; ``max_age``: per
        read path, the oldest reading taken from it (seconds); ``count(path, source)``: a read
        answered by ``"backend"`` or ``"worker0"``."""
        self._client = client
        self._cache = cache
        self._leader = leader
        self._max_age = max_age
        self._count = count

    async def get(self, backend: BackendSpec, path: str, *, within: float) -> tuple[int, bytes]:
        if self._leader is not None and path in READ_PATHS:
            shared = await self._ask(backend, path, min(within, _ASK_WITHIN_S))
            if shared is not None:
                self._count(path, "worker0")
                if shared.error is not None:
                    raise UpstreamUnreachable(shared.error)
                return shared.status, shared.body
        self._count(path, "backend")
        try:
            status, body = await self._client.get(backend, path, within=within)
        except UpstreamError as exc:
            if self._leader is None:
                self._cache.put(backend.url, path, Reading(time.monotonic(), 0, b"", exc.message))
            raise
        if self._leader is None:
            self._cache.put(backend.url, path, Reading(time.monotonic(), status, body))
        return status, body

    async def _ask(self, backend: BackendSpec, path: str, within: float) -> Reading | None:
        assert self._leader is not None
        query = urlencode({"url": backend.url, "path": path})
        answer = await ask_peer(self._leader, "GET", f"{READ_PATH}?{query}", within=within)
        if isinstance(answer, str) or answer[0] != 200:
            return None  # worker 0 cannot be asked (it is being started again) or has none
        return _decode(answer[1], self._max_age.get(path, 0.0))


def _decode(raw: bytes, max_age: float) -> Reading | None:
    head, _, body = raw.partition(b"\n")
    try:
        at_s, status_s, error_s = head.decode().split("\t", 2)
        reading = Reading(float(at_s), int(status_s), body, error_s or None)
    except ValueError:
        return None
    return reading if time.monotonic() - reading.at <= max_age else None


def _encode(reading: Reading) -> bytes:
    """A reading as worker 0 answers it: ``at<TAB>status<TAB>error`` on one line, the body."""
    error = (reading.error or "").replace("\t", " ").replace("\n", " ")
    return f"{reading.at!r}\t{reading.status}\t{error}\n".encode() + reading.body


def read_handler(cache: ReadCache) -> Handler:
    """``GET /backend-read?url=...&path=...`` on worker 0's private socket: its latest
    reading (404: none)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        reading = cache.get(request.query.get("url", ""), request.query.get("path", ""))
        if reading is None:
            raise web.HTTPNotFound()
        return web.Response(body=_encode(reading), content_type="application/octet-stream")

    return handler
