"""The wait for a response head (``backends.upstream.client.HeadWait``): bounded by the idle
watchdog, ended at once by the attempt's interrupt, and on every way out nothing left watched
and no connection kept."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from backends.errors import BackendDown, UpstreamTimeout
from backends.state import BackendSpec
from backends.upstream.client import Interrupt, UpstreamClient
from tests.waiting import wait_for


@asynccontextmanager
async def silent_backend() -> AsyncIterator[tuple[BackendSpec, list[bytes]]]:
    """A server that reads requests and never answers them."""
    got: list[bytes] = []

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.read(65536))
        await reader.read()  # until the gateway closes its side
        writer.close()

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield BackendSpec(id="silent", url=f"http://127.0.0.1:{port}"), got
    finally:
        server.close()


@asynccontextmanager
async def client(idle_timeout: float) -> AsyncIterator[UpstreamClient]:
    c = UpstreamClient(connect_timeout=1.0, idle_timeout=idle_timeout)
    try:
        yield c
    finally:
        await c.close()


async def closed(c: UpstreamClient) -> None:
    """The connection is closed (the transport reports it a turn later)."""
    await wait_for(lambda: len(c.pool) == 0, what="the connection closed")


async def test_a_head_that_never_comes_times_out_with_the_idle_timeout() -> None:
    async with silent_backend() as (backend, got), client(0.2) as c:
        started = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await c.open(backend, "/v1/completions", b"{}", {})
        took = time.monotonic() - started
        assert got
        assert got[0].startswith(b"POST /v1/completions HTTP/1.1")
        assert 0.2 <= took < 0.2 + c.watchdog.interval + 0.2
        assert len(c.watchdog) == 0  # nothing left watched
        await closed(c)  # the connection was closed: the backend learns to abort


async def test_an_interrupt_ends_the_wait_at_once_as_the_backend_marked_down() -> None:
    async with silent_backend() as (backend, got), client(30.0) as c:
        interrupt = Interrupt()
        opening = asyncio.create_task(
            c.open(backend, "/v1/completions", b"{}", {}, interrupt=interrupt)
        )
        await wait_for(lambda: bool(got), what="the request sent")
        started = time.monotonic()
        interrupt.fire()
        with pytest.raises(BackendDown):
            await opening
        assert time.monotonic() - started < 1.0
        assert len(c.watchdog) == 0
        await closed(c)
        await asyncio.sleep(0)  # no cancellation is left pending on this task
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_cancelled_wait_stays_a_cancellation_and_leaves_nothing_behind() -> None:
    async with silent_backend() as (backend, got), client(30.0) as c:
        task = asyncio.create_task(c.open(backend, "/v1/completions", b"{}", {}))
        await wait_for(lambda: bool(got), what="the request sent")
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(c.watchdog) == 0
        await closed(c)
