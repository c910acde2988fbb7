"""A server under test on a port of its own, and a raw client that sends exact bytes and reads
answers as they come (``Reply``)."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict

from backends.errors import GatewayError
from gateway.http import (
    Handler,
    LogSampler,
    Request,
    Response,
    Routes,
    Server,
    ServerConfig,
    StreamResponse,
    json_response,
)


@dataclass
class Served:
    server: Server
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def open_connections(self) -> int:
        return len(self.server.connections)


def bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


@asynccontextmanager
async def serving(
    handler: Handler,
    *,
    sampler: LogSampler | None = None,
    tls: ssl.SSLContext | None = None,
    grace: float = 1.0,
    **config: Any,
) -> AsyncIterator[Served]:
    """``handler`` served on 127.0.0.1 (a port of its own) until the block ends."""
    config.setdefault("max_body_bytes", 1 << 20)
    server = Server(handler, ServerConfig(**config), sampler=sampler)
    sock = bound_socket()
    await server.start(sock=sock, ssl=tls)
    try:
        yield Served(server, sock.getsockname()[1])
    finally:
        await server.cleanup(grace)


def routed(router: Routes) -> Handler:
    """A minimal middleware: the route, and a ``GatewayError`` as its JSON answer."""

    async def handle(request: Request) -> Response | StreamResponse:
        try:
            handler, request.match_info = router.resolve(request.method, request.path)
            return await handler(request)
        except GatewayError as err:
            return json_response(err.envelope(), status=err.status, headers=err.headers)

    return handle


def one_route(
    handler: Callable[[Request], Awaitable[Response | StreamResponse]], path: str = "/x"
) -> Handler:
    router = Routes()
    for method in ("GET", "POST"):
        router.add(method, path, handler)
    return routed(router)


@dataclass
class Reply:
    status: int
    headers: CIMultiDict[str]
    body: bytes
    head: bytes


class RawClient:
    """A client that writes exact bytes and reads answers off the socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def reply(self, *, head_only: bool = False, within: float = 5.0) -> Reply:
        """The next answer (``head_only``: an answer to HEAD, which has no body)."""
        async with asyncio.timeout(within):
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            headers: CIMultiDict[str] = CIMultiDict()
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers.add(name.strip(), value.strip())
            if head_only or status < 200 or status in (204, 304):
                return Reply(status, headers, b"", head)
            if headers.get("Transfer-Encoding") == "chunked":
                body = b""
                while True:
                    size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
                    data = await self.reader.readexactly(size + 2)
                    if size == 0:
                        break
                    body += data[:-2]
            elif "Content-Length" in headers:
                body = await self.reader.readexactly(int(headers["Content-Length"]))
            else:
                body = await self.reader.read()
            return Reply(status, headers, body, head)

    async def rest(self, within: float = 5.0) -> bytes:
        """Everything until the server closes the connection (it must, ``within`` seconds)."""
        out = b""
        async with asyncio.timeout(within):
            try:
                while chunk := await self.reader.read(65536):
                    out += chunk
            except ConnectionResetError:
                pass
        return out

    def close(self) -> None:
        self.writer.close()

    async def __aenter__(self) -> RawClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.writer.close()
        with suppress(ConnectionError, ssl.SSLError):
            await self.writer.wait_closed()
