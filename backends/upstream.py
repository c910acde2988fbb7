"""The upstream client: the one place where aiohttp client errors become gateway errors.

It owns the pooled ``ClientSession``. ``open`` sends a request and returns once the backend's
status line and headers have arrived, as an ``Upstream`` whose body the caller reads; the
caller must then ``finish`` it: back to the keep-alive pool after a complete read, or closed
otherwise, which is what makes vLLM abort a generation nobody is waiting for.

Timeouts: connecting has its own; waiting for the response head is bounded by the idle timeout;
after that an ``IdleWatchdog`` cuts a body that stops moving (see ``backends.idle``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError as BadFraming
from multidict import CIMultiDict

from backends.errors import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from backends.idle import IdleWatch, IdleWatchdog
from backends.state import BackendSpec
from backends.supervise import Supervisor


def translate(exc: BaseException, backend: BackendSpec) -> UpstreamError:
    """Map an aiohttp/OS error from talking to ``backend`` onto the gateway's tree."""
    where = f"backend {backend.id}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamUnreachable(f"{where}: connect timed out")
    if isinstance(exc, aiohttp.ServerTimeoutError | asyncio.TimeoutError | TimeoutError):
        return UpstreamTimeout(f"{where}: no data within the idle timeout")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamUnreachable(f"{where}: cannot connect ({exc.os_error.strerror or exc})")
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError | OSError):
        return UpstreamUnreachable(f"{where}: connection lost")
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ClientResponseError | BadFraming):
        return UpstreamProtocolError(f"{where}: malformed response")
    return UpstreamUnreachable(f"{where}: {type(exc).__name__}")


CLIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, OSError)


@dataclass(slots=True)
class Upstream:
    """A response whose head has arrived; ``watch.activity`` is bumped per body read."""

    backend: BackendSpec
    response: aiohttp.ClientResponse
    watch: IdleWatch


class UpstreamClient:
    def __init__(
        self,
        *,
        connect_timeout: float,
        idle_timeout: float,
        max_connections: int = 0,
        keepalive_timeout: float = 4.0,
        supervisor: Supervisor | None = None,
    ) -> None:
        self._connector = aiohttp.TCPConnector(
            limit=max_connections,
            limit_per_host=0,
            # Shorter than the backend's own (vLLM's uvicorn closes idle connections after 5 s):
            # reusing a connection the server is closing fails a request for nothing.
            keepalive_timeout=keepalive_timeout,
        )
        self._idle_timeout = idle_timeout
        self.watchdog = IdleWatchdog(idle_timeout)
        # auto_decompress off: bytes pass through as the backend sent them.
        self._session = aiohttp.ClientSession(
            connector=self._connector,
            timeout=aiohttp.ClientTimeout(total=None, connect=None, sock_connect=connect_timeout),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        self._watchdog_task = (supervisor or Supervisor()).spawn(
            "idle_watchdog", "idle-watchdog", self.watchdog.run
        )

    async def close(self) -> None:
        self._watchdog_task.cancel()
        await asyncio.gather(self._watchdog_task, return_exceptions=True)
        await self._session.close()

    async def open(
        self,
        backend: BackendSpec,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
    ) -> Upstream:
        """POST ``body`` and return once the response head is in."""
        hdrs = CIMultiDict(headers)
        if backend.api_key:
            hdrs["Authorization"] = f"Bearer {backend.api_key}"
        try:
            async with asyncio.timeout(self._idle_timeout):
                resp = await self._session.post(backend.url + path, data=body, headers=hdrs)
        except CLIENT_ERRORS as exc:
            raise translate(exc, backend) from exc

        def on_idle() -> None:
            resp.content.set_exception(aiohttp.SocketTimeoutError("idle timeout"))

        return Upstream(backend, resp, self.watchdog.watch(on_idle))

    async def read_body(self, upstream: Upstream) -> bytes:
        try:
            return await upstream.response.read()
        except CLIENT_ERRORS as exc:
            raise translate(exc, upstream.backend) from exc

    def finish(self, upstream: Upstream, *, complete: bool) -> None:
        """Return the connection to the pool after a complete read; close it otherwise."""
        self.watchdog.unwatch(upstream.watch)
        if complete:
            upstream.response.release()
        else:
            upstream.response.close()

    async def get(self, backend: BackendSpec, path: str, *, within: float) -> tuple[int, bytes]:
        """A small GET for monitors, with its own overall timeout."""
        hdrs = {"Authorization": f"Bearer {backend.api_key}"} if backend.api_key else None
        try:
            async with self._session.get(
                backend.url + path,
                headers=hdrs,
                timeout=aiohttp.ClientTimeout(total=within),
            ) as resp:
                return resp.status, await resp.read()
        except CLIENT_ERRORS as exc:
            raise translate(exc, backend) from exc


def json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None
