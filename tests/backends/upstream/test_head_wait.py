"""The wait for a response head (``backends.upstream.client.HeadWait``): bounded by the idle
watchdog, ended at once by the attempt's interrupt, and on every way out nothing left watched
and no connection kept."""

from __future__ import annotations

import asyncio
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


class Clock:
    """The watchdog's time, moved only by the test: its own sweeps never see time pass."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def client(idle_timeout: float, clock: Clock) -> AsyncIterator[UpstreamClient]:
    c = UpstreamClient(connect_timeout=1.0, idle_timeout=idle_timeout, clock=clock)
    try:
        yield c
    finally:
        await c.close()


async def closed(c: UpstreamClient) -> None:
    """The connection is closed (the transport reports it a turn later)."""
    await wait_for(lambda: len(c.pool) == 0, what="the connection closed")


async def test_a_head_that_never_comes_times_out_with_the_idle_timeout() -> None:
    clock = Clock()
    async with silent_backend() as (backend, got), client(0.2, clock) as c:
        opening = asyncio.create_task(c.open(backend, "/v1/completions", b"{}", {}))
        await wait_for(lambda: bool(got), what="the request sent")
        assert got[0].startswith(b"POST /v1/completions HTTP/1.1")
        await wait_for(lambda: len(c.watchdog) == 1, what="the head's wait watched")
        # No await between moving the clock and sweeping: the watchdog's own loop cannot
        # sweep in between, so each sweep here is the one that decides.
        clock.now += 0.19
        assert c.watchdog.sweep(clock()) == []
        assert not opening.done()
        clock.now += 0.01
        assert len(c.watchdog.sweep(clock())) == 1
        with pytest.raises(UpstreamTimeout):
            await opening
        assert len(c.watchdog) == 0  # nothing left watched
        await closed(c)  # the connection was closed: the backend learns to abort


async def test_an_interrupt_ends_the_wait_at_once_as_the_backend_marked_down() -> None:
    # The watchdog's clock never moves: only the interrupt can end the wait.
    async with silent_backend() as (backend, got), client(30.0, Clock()) as c:
        interrupt = Interrupt()
        opening = asyncio.create_task(
            c.open(backend, "/v1/completions", b"{}", {}, interrupt=interrupt)
        )
        await wait_for(lambda: bool(got), what="the request sent")
        interrupt.end(BackendDown("backend b: marked down"))
        with pytest.raises(BackendDown, match="backend b: marked down"):
            await opening
        assert len(c.watchdog) == 0
        await closed(c)
        await asyncio.sleep(0)  # no cancellation is left pending on this task
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_cancelled_wait_stays_a_cancellation_and_leaves_nothing_behind() -> None:
    async with silent_backend() as (backend, got), client(30.0, Clock()) as c:
        task = asyncio.create_task(c.open(backend, "/v1/completions", b"{}", {}))
        await wait_for(lambda: bool(got), what="the request sent")
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(c.watchdog) == 0
        await closed(c)
