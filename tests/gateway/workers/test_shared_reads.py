"""Reads of the backends shared by the workers of a host (``gateway.workers.shared_reads``): worker
0 reads and keeps; another worker takes worker 0's reading while it is fresh, and reads the backend
itself when it is stale, missing, or worker 0 cannot be asked."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from backends.errors import UpstreamUnreachable
from backends.state import BackendSpec
from gateway.workers.shared_reads import READ_PATH, ReadCache, Reading, SharedReads, read_handler

SPEC = BackendSpec(id="127.0.0.1:9", url="http://127.0.0.1:9")


class Backend:
    """What a worker's own reads of the backend answer, counted."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.fail = False

    async def get(self, backend: BackendSpec, path: str, *, within: float) -> tuple[int, bytes]:
        self.asked.append(path)
        if self.fail:
            raise UpstreamUnreachable("backend 127.0.0.1:9: cannot connect")
        return 200, f"read {len(self.asked)}".encode()


@asynccontextmanager
async def leader(cache: ReadCache) -> AsyncIterator[Path]:
    """Worker 0's private socket, answering its readings."""
    app = web.Application()
    app.router.add_get(READ_PATH, read_handler(cache))
    runner = web.AppRunner(app)
    await runner.setup()
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "private-0.sock"
        await web.UnixSite(runner, str(sock)).start()
        try:
            yield sock
        finally:
            await runner.cleanup()


async def test_worker_0_reads_and_keeps_the_others_take_it_while_fresh() -> None:
    cache, counted = ReadCache(), []
    first, other = Backend(), Backend()
    zero = SharedReads(first, cache, None, {"/metrics": 60.0, "/health": 60.0})
    async with leader(cache) as sock:
        one = SharedReads(
            other,
            cache,
            sock,
            {"/metrics": 60.0, "/health": 60.0},
            lambda path, source: counted.append((path, source)),
        )
        assert await zero.get(SPEC, "/metrics", within=1) == (200, b"read 1")
        assert await one.get(SPEC, "/metrics", within=1) == (200, b"read 1")
        assert other.asked == []  # taken from worker 0
        # Nothing read yet by worker 0: read itself.
        assert await one.get(SPEC, "/health", within=1) == (200, b"read 1")
        assert other.asked == ["/health"]
        # A failed read is passed on as the same failure, with its reason.
        first.fail = True
        with pytest.raises(UpstreamUnreachable):
            await zero.get(SPEC, "/health", within=1)
        with pytest.raises(UpstreamUnreachable, match="cannot connect"):
            await one.get(SPEC, "/health", within=1)
        assert other.asked == ["/health"]
        # A path that is not one of the monitor's reads is never shared.
        await one.get(SPEC, "/v1/other", within=1)
        assert other.asked[-1] == "/v1/other"
        assert counted == [
            ("/metrics", "worker0"),
            ("/health", "backend"),
            ("/health", "worker0"),
            ("/v1/other", "backend"),
        ]


async def test_a_stale_reading_or_an_unreachable_worker_0_means_reading_the_backend() -> None:
    cache, other = ReadCache(), Backend()
    cache.put(SPEC.url, "/metrics", Reading(0.0, 200, b"long ago"))  # monotonic 0: stale
    async with leader(cache) as sock:
        one = SharedReads(other, cache, sock, {"/metrics": 1.0})
        assert await one.get(SPEC, "/metrics", within=1) == (200, b"read 1")
    # Worker 0 gone (its socket closed): read, not failed.
    assert await one.get(SPEC, "/metrics", within=1) == (200, b"read 2")
    assert other.asked == ["/metrics", "/metrics"]
