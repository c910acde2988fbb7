"""Serving a simulator app: the runner, its listening socket, and the refuse fault.

``SimServer`` owns the ``AppRunner`` (always with ``handler_cancellation=True``, so a
client disconnect aborts the request) and the TCP site. The ``refuse_connections``
fault closes the listening socket, so connecting fails at once with "connection
refused" as it does when a server is down; clearing it binds the same port again.
``kill`` crashes the server instead: every open connection reset, then stopped.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from tools.sim.config import SimConfig
from tools.sim.driver import EngineDriver
from tools.sim.engine import Engine
from tools.sim.faults import Faults
from tools.sim.http import STATE
from tools.sim.kvevents import KvEvents
from tools.sim.server import KV_EVENTS, create_app
from tools.sim.state import SimState


class SimServer:
    """One simulator listening on ``host:port`` (port 0 picks a free one)."""

    def __init__(
        self,
        config: SimConfig,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: Faults | None = None,
        backlog: int = 4096,
    ) -> None:
        self.config = config
        self.host = host
        self.port = port
        self._backlog = backlog
        self.app = create_app(config, faults)
        self.state: SimState = self.app[STATE]
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        self._site: web.TCPSite | None = None
        self._lock = asyncio.Lock()
        self._pending: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def listening(self) -> bool:
        """Whether the listening socket is open (it is not while refusing connections)."""
        return self._site is not None

    @property
    def engine(self) -> Engine:
        return self.state.engine

    @property
    def driver(self) -> EngineDriver:
        return self.state.driver

    @property
    def kv_events(self) -> KvEvents:
        """KV-cache event publishing: ``endpoint``/``replay_endpoint`` as bound, ``publisher``."""
        return self.app[KV_EVENTS]

    @property
    def faults(self) -> Faults:
        return self.state.faults

    @faults.setter
    def faults(self, value: Faults) -> None:
        """Change faults now; the listening socket follows soon after (see set_faults)."""
        self.state.faults = value

    async def set_faults(self, value: Faults) -> None:
        """Change faults and wait until the listening socket matches them."""
        self.state.faults = value
        await self._sync_listener()

    async def start(self) -> None:
        await self._runner.setup()
        await self._listen()  # always bind first, so that port 0 becomes a real port
        self.state.add_faults_listener(self._on_faults)
        await self._sync_listener()

    async def stop(self) -> None:
        for task in list(self._pending):
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        await self._runner.cleanup()

    async def kill(self) -> None:
        """Crash, as a killed process does: stop listening, reset every open connection
        (idle keep-alive ones too) at once, then stop. Each request cut short frees its
        engine slot, as on any disconnect."""
        async with self._lock:
            site, self._site = self._site, None
            if site is not None:
                await site.stop()
        server = self._runner.server
        for conn in server.connections if server is not None else ():
            if conn.transport is not None:
                conn.transport.abort()
        await self.stop()

    def _on_faults(self, faults: Faults) -> None:
        task = asyncio.get_running_loop().create_task(self._sync_listener())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _sync_listener(self) -> None:
        async with self._lock:
            refuse = self.state.faults.refuse_connections
            if refuse and self._site is not None:
                site, self._site = self._site, None
                await site.stop()
            elif not refuse and self._site is None:
                await self._listen()

    async def _listen(self) -> None:
        site = web.TCPSite(
            self._runner, self.host, self.port, backlog=self._backlog, reuse_address=True
        )
        await site.start()
        self.port = site.port
        self._site = site
