"""A raw byte-splicing TCP proxy on uvloop: the per-event floor of Python and uvloop.

Each client connection gets one upstream connection (round robin over the ports given) for its
lifetime, and bytes go across as they come: no HTTP parsing, no routing. Usage:
``raw_proxy.py LISTEN_PORT BACKEND_PORT [BACKEND_PORT ...]`` (all on 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import Iterator
from typing import cast

import uvloop


class Upstream(asyncio.Protocol):
    def __init__(self, down: Downstream) -> None:
        self.down = down
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        assert self.down.transport is not None
        self.down.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.down.transport is not None:
            self.down.transport.close()


class Downstream(asyncio.Protocol):
    def __init__(self, ports: Iterator[int]) -> None:
        self.ports = ports
        self.transport: asyncio.Transport | None = None
        self.up: Upstream | None = None
        self.early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        asyncio.get_running_loop().create_task(self._connect(next(self.ports)))

    async def _connect(self, port: int) -> None:
        loop = asyncio.get_running_loop()
        _, up = await loop.create_connection(lambda: Upstream(self), "127.0.0.1", port)
        self.up = up
        assert up.transport is not None
        for data in self.early:
            up.transport.write(data)
        self.early.clear()

    def data_received(self, data: bytes) -> None:
        if self.up is None or self.up.transport is None:
            self.early.append(data)
        else:
            self.up.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.close()


async def main(listen: int, backends: list[int]) -> None:
    ports = itertools.cycle(backends)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Downstream(ports), "127.0.0.1", listen)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]), [int(p) for p in sys.argv[2:]]))
