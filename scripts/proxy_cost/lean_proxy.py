"""What a server of our own would cost: an HTTP/1.1 server protocol on uvloop (``httptools``,
llhttp, parses the requests), ``backends.upstream.h1``'s client, a ``readany``/write loop; no
limits, routing, metrics or logs. The same work as ``bare_proxy.py`` with aiohttp's server side
taken out, to measure that side. Usage: ``lean_proxy.py LISTEN_PORT BACKEND_PORT [BACKEND_PORT
...]`` (all on 127.0.0.1; run with the repository on ``PYTHONPATH``).

A measuring tool, not a server: one request at a time per connection (no pipelining), bodies
in memory, no limits on sizes, errors answered 502 and the connection closed.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import Iterator

import httptools
import uvloop

from backends.upstream import h1

_HEAD = b"HTTP/1.1 %d OK\r\nContent-Type: %b\r\nTransfer-Encoding: chunked\r\n\r\n"


class Conn(asyncio.Protocol):
    def __init__(self, pool: h1.ConnectionPool, ports: Iterator[int]) -> None:
        self._pool = pool
        self._ports = ports
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []
        self._task: asyncio.Task[None] | None = None
        self._drained: asyncio.Future[None] | None = None  # set while writing is paused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self.resume_writing()
        if self._task is not None:
            self._task.cancel()  # the client left: closing the upstream aborts it

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.close()

    # httptools' callbacks
    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body, path = b"".join(self._body), self._url.decode()
        self._body, self._url = [], b""
        self._task = asyncio.get_running_loop().create_task(self._relay(path, body))

    async def _relay(self, path: str, body: bytes) -> None:
        transport = self._transport
        assert transport is not None
        url = f"http://127.0.0.1:{next(self._ports)}"
        try:
            up = await self._pool.request(
                "POST", url, path, {"Content-Type": "application/json"}, body=body
            )
        except Exception:
            transport.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            transport.close()
            return
        complete = False
        try:
            first = True
            while chunk := await up.readany():
                frame = b"%x\r\n%b\r\n" % (len(chunk), chunk)
                if first:
                    frame = _HEAD % (up.status, up.content_type.encode()) + frame
                    first = False
                transport.write(frame)
                if self._drained is not None:  # the client reads slower than the backend
                    await self._drained
            if first:
                transport.write(_HEAD % (up.status, up.content_type.encode()))
            transport.write(b"0\r\n\r\n")
            complete = True
        finally:
            self._pool.release(up, complete=complete)
            self._task = None


async def main(port: int, backends: list[int]) -> None:
    pool = h1.ConnectionPool(connect_timeout=5, keepalive_timeout=4)
    ports = itertools.cycle(backends)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Conn(pool, ports), "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]), [int(p) for p in sys.argv[2:]]))
