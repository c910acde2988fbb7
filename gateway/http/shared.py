"""What every connection of one server shares, and the answers the server gives on its own."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import TYPE_CHECKING, Generic, TypeVar

import structlog

from gateway.http.head import HttpDate, status_line
from gateway.http.refusal import Refused, default_error_body
from gateway.http.sampling import LogSampler

if TYPE_CHECKING:
    from gateway.http.config import ServerConfig
    from gateway.http.routes import Handler

log = structlog.get_logger("gateway.http")

# A connection (``gateway.http.protocol.Connection``), named by a type parameter so this module
# need not import the one that imports it.
C = TypeVar("C", bound=Hashable)


class Shared(Generic[C]):
    """What every connection of a server shares: its settings, handler, the log sampler,
    and the set of open connections (for the server's graceful stop)."""

    __slots__ = ("_emptied", "config", "connections", "date", "handler", "sampler", "server")

    def __init__(
        self,
        config: ServerConfig,
        handler: Handler,
        sampler: LogSampler,
        date: HttpDate,
    ) -> None:
        self.config = config
        self.handler = handler
        self.sampler = sampler
        self.date = date
        self.server = b"Server: %s\r\n" % config.server_name.encode() if config.server_name else b""
        self.connections: set[C] = set()
        self._emptied: asyncio.Event | None = None

    def log_refusal(self, refused: Refused, peer: str | None) -> None:
        """One ``http_refused`` line, unless the sampler drops it (a flood); the first line
        after a dropped run says how many it dropped."""
        suppressed = self.sampler.admit()
        if suppressed is None:
            return
        if suppressed:
            log.info(
                "http_refused",
                status=refused.status,
                reason=refused.reason,
                peer=peer,
                suppressed=suppressed,
            )
        else:
            log.info("http_refused", status=refused.status, reason=refused.reason, peer=peer)

    def error_answer(self, status: int, message: str, path: str | None) -> bytes:
        """An answer of the server's own (a refusal), whole, closing the connection."""
        try:
            body = self.config.error_body(status, message, path)
        except Exception:
            log.exception("error_body_failed", status=status)
            body = default_error_body(status, message, path)
        return b"".join(
            (
                status_line(status),
                b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body),
                self.date(),
                self.server,
                b"Connection: close\r\n\r\n",
                body,
            )
        )

    def lost(self, conn: C) -> None:
        self.connections.discard(conn)
        if not self.connections and self._emptied is not None:
            self._emptied.set()

    async def emptied(self) -> None:
        """Until no connection is open."""
        if not self.connections:
            return
        if self._emptied is None:
            self._emptied = asyncio.Event()
        self._emptied.clear()
        await self._emptied.wait()
