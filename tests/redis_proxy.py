"""A TCP proxy in front of a Redis for tests: what a client sends reaches Redis at once, and
Redis's answers can be held and let through later (``release``): a write lands while its
answer comes late, as over a slow network or from an overloaded Redis. ``hold()`` holds every
answer; ``hold(after=b"XADD")`` only those on connections that sent it (the writers), so the
rest of the clients (readers) go on as before."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable


class HoldingProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self._open = asyncio.Event()
        self._open.set()
        self._after: bytes | None = None  # hold only connections that sent this
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def hold(self, after: bytes | None = None) -> None:
        """From now on Redis's answers wait here (what the clients send still goes through);
        ``after``: only on the connections that send it."""
        self._after = after
        self._open.clear()

    def release(self) -> None:
        self._after = None
        self._open.set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        marked = asyncio.Event()  # it sent what marks a connection to hold
        ahead = asyncio.create_task(self._ahead(reader, up_writer, marked))
        back = asyncio.create_task(self._back(up_reader, writer, marked))
        self._tasks |= {ahead, back}
        ahead.add_done_callback(self._tasks.discard)
        back.add_done_callback(self._tasks.discard)

    async def _ahead(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, marked: asyncio.Event
    ) -> None:
        async def look(data: bytes) -> None:
            if self._after is not None and self._after in data:
                marked.set()

        await _pump(reader, writer, look)

    async def _back(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, marked: asyncio.Event
    ) -> None:
        async def hold(_data: bytes) -> None:
            if not self._open.is_set() and (self._after is None or marked.is_set()):
                await self._open.wait()

        await _pump(reader, writer, hold)


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    before: Callable[[bytes], Awaitable[None]],
) -> None:
    """Bytes from ``reader`` to ``writer``, each read first shown to ``before``."""
    try:
        while data := await reader.read(65536):
            await before(data)
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def holding_proxy(target_port: int) -> AsyncIterator[HoldingProxy]:
    proxy = HoldingProxy(target_port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
