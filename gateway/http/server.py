"""The server: listeners and their connections (``gateway.http.protocol``).

``start`` opens a listener (more than once for several), ``cleanup`` stops gracefully: no new
connections, idle ones closed at once, each busy one closed after the answers it owes; past
``grace`` seconds what still runs is cancelled and cut. What the handler uses is the caller's
to open before and close after (``gateway.root``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl as ssl_

from gateway.http.config import ServerConfig
from gateway.http.head import HttpDate
from gateway.http.protocol import Connection
from gateway.http.routes import Handler
from gateway.http.sampling import LogSampler
from gateway.http.shared import Shared


class Server:
    """The gateway's HTTP/1.1 server for ``handler`` (the whole request path: it answers
    every request, and raises nothing but ``CancelledError``)."""

    def __init__(
        self,
        handler: Handler,
        config: ServerConfig,
        *,
        sampler: LogSampler | None = None,
    ) -> None:
        self.config = config
        self._shared: Shared[Connection] = Shared(
            config, handler, sampler or LogSampler(), HttpDate()
        )
        self._listeners: list[asyncio.Server] = []
        self._stopping: asyncio.Task[None] | None = None

    @property
    def connections(self) -> frozenset[Connection]:
        """The open connections (a snapshot)."""
        return frozenset(self._shared.connections)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Where the listeners listen (host, port)."""
        found = []
        for listener in self._listeners:
            for sock in listener.sockets:
                name = sock.getsockname()
                if isinstance(name, tuple):
                    found.append((str(name[0]), int(name[1])))
        return found

    async def start(
        self,
        *,
        sock: socket.socket | None = None,
        host: str | None = None,
        port: int | None = None,
        ssl: ssl_.SSLContext | None = None,
        reuse_port: bool = False,
        backlog: int = 128,
    ) -> None:
        """Listen on ``sock``, or on ``host``:``port``; may be called again for more."""
        if self._stopping is not None:
            raise RuntimeError("the server is stopping")
        loop = asyncio.get_running_loop()
        shared = self._shared

        def factory() -> Connection:
            return Connection(shared)

        if sock is not None:
            listener = await loop.create_server(factory, sock=sock, ssl=ssl, backlog=backlog)
        elif port is None:
            raise ValueError("start() needs a sock, or a port (and a host)")
        else:
            listener = await loop.create_server(
                factory,
                host,
                port,
                ssl=ssl,
                reuse_address=True,
                reuse_port=reuse_port or None,
                backlog=backlog,
            )
        self._listeners.append(listener)

    async def cleanup(self, grace: float) -> None:
        """Stop gracefully (see the module's docstring); again: wait for the first."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float) -> None:
        for listener in self._listeners:
            listener.close()
        shared = self._shared
        for conn in list(shared.connections):
            conn.shutdown()
        if shared.connections:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(grace, 0)):
                    await shared.emptied()
        if shared.connections:
            left = list(shared.connections)
            tasks = [conn.task for conn in left if conn.task is not None]
            for conn in left:
                conn.abort()
            if tasks:
                await asyncio.wait(tasks, timeout=5.0)  # cancelled: they end at their next await
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await shared.emptied()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                for listener in self._listeners:
                    await listener.wait_closed()
