"""What a handler answers: a whole ``Response`` or a ``StreamResponse`` written as it goes.

A whole answer goes out in one write, with its ``Content-Length``. A stream's head is fixed by
``prepare`` but held until the first ``write``, and goes out in the same write as that first
chunk (one write on the way to the first token), or alone at ``write_eof``/``flush_head``.
Streams are chunked unless their ``content_length`` was set. The connection adds ``Date``,
``Connection: close`` (when it will close after the answer) and the blank line when the head
goes out.

For the gateway's splice (``gateway.request.relay``), which writes chunk frames straight to
the client's transport, a stream exposes that transport, whether it is ``chunked``, the
transport's flow control (``writing_paused``, ``drain``) and ``flush_head``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from multidict import CIMultiDict

from gateway.http.head import header_block, status_line

if TYPE_CHECKING:
    from gateway.http.message import Request

_LAST_CHUNK = b"0\r\n\r\n"


class Writer(Protocol):
    """The connection, as a response sees it (``gateway.http.protocol.Connection``)."""

    @property
    def transport(self) -> asyncio.Transport | None: ...

    @property
    def writing_paused(self) -> bool: ...

    def seal_head(self, request: Request, head: bytes, *, close: bool, date: bool) -> bytes:
        """The head completed with what the connection adds (``Date``, ``Connection``)."""

    def send(self, data: bytes) -> None:
        """Write to the client; ``ConnectionResetError`` if it is gone."""

    def finished(self, request: Request) -> None:
        """The whole answer to ``request`` has been written."""

    async def drain(self) -> None:
        """Until the client has read enough; ``ConnectionResetError`` if it is gone."""


def _writer(request: Request) -> Writer:
    channel = request._channel
    if channel is None:
        raise RuntimeError("the request is not on a connection")
    return cast("Writer", channel)  # the connection is both


class StreamResponse:
    """An answer written in pieces: ``prepare``, ``write``..., ``write_eof``."""

    __slots__ = (
        "_chunked",
        "_eof",
        "_head",
        "_no_body",
        "_request",
        "_writer",
        "headers",
        "reason",
        "status",
    )

    def __init__(
        self,
        *,
        status: int = 200,
        reason: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers: CIMultiDict[str] = CIMultiDict(headers) if headers else CIMultiDict()
        self._writer: Writer | None = None
        self._request: Request | None = None
        self._head: bytes | None = None  # prepared, not yet written
        self._chunked = False
        self._no_body = False  # HEAD, 1xx, 204, 304: the head alone
        self._eof = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.status}>"

    @property
    def content_type(self) -> str | None:
        return self.headers.get("Content-Type")

    @content_type.setter
    def content_type(self, value: str | None) -> None:
        if value is None:
            self.headers.popall("Content-Type", None)
        else:
            self.headers["Content-Type"] = value

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        return int(value) if value is not None else None

    @content_length.setter
    def content_length(self, value: int | None) -> None:
        if value is None:
            self.headers.popall("Content-Length", None)
        else:
            self.headers["Content-Length"] = str(int(value))

    @property
    def prepared(self) -> bool:
        return self._writer is not None

    @property
    def chunked(self) -> bool:
        return self._chunked

    @property
    def transport(self) -> asyncio.Transport | None:
        """The client's transport (None before ``prepare`` and once the client is gone)."""
        return self._writer.transport if self._writer is not None else None

    @property
    def writing_paused(self) -> bool:
        """Whether the client's transport holds more than it should (``drain`` then)."""
        return self._writer is not None and self._writer.writing_paused

    @property
    def flow(self) -> Writer | None:
        """The connection's flow control (``writing_paused``), for a writer that checks it
        per event (the splice): one attribute read, not a chain of properties."""
        return self._writer

    async def drain(self) -> None:
        """Until the client has read enough; ``ConnectionResetError`` if it is gone or reads
        nothing for the server's ``send_timeout``."""
        if self._writer is None:
            raise RuntimeError("drain() before prepare()")
        await self._writer.drain()

    # -- the head --------------------------------------------------------------------

    async def prepare(self, request: Request) -> None:
        """Fix the head (it goes out with the first write)."""
        self._prepare(request)

    def _prepare(self, request: Request) -> None:
        if self._writer is not None:
            return
        writer = _writer(request)
        headers = self.headers
        status = self.status
        close = False
        if "Connection" in headers:  # the connection's to say; a handler may ask to close
            close = "close" in headers.popall("Connection")[0].lower()
        headers.popall("Transfer-Encoding", None)
        if status < 200 or status in (204, 304):
            headers.popall("Content-Length", None)
            self._no_body = True
        elif "Content-Length" not in headers:
            if request.version >= (1, 1):
                self._chunked = True
                headers["Transfer-Encoding"] = "chunked"
            else:
                close = True  # HTTP/1.0 without a length: the body ends with the connection
            if "Content-Type" not in headers:
                headers["Content-Type"] = "application/octet-stream"
        if request.method == "HEAD":
            self._no_body = True
        head = status_line(status, self.reason) + header_block(headers)
        self._writer = writer
        self._request = request
        self._head = writer.seal_head(request, head, close=close, date="Date" not in headers)

    def flush_head(self) -> None:
        """Write the held head now, if it has not gone out yet."""
        head = self._head
        if head is not None and self._writer is not None:
            self._head = None
            self._writer.send(head)

    # -- the body --------------------------------------------------------------------

    async def write(self, data: bytes) -> None:
        """One piece of the body (a chunk frame when chunked); waits while the client's
        transport is full."""
        writer = self._writer
        if writer is None:
            raise RuntimeError("write() before prepare()")
        if self._eof:
            raise RuntimeError("write() after write_eof()")
        if not data or self._no_body:
            return
        frame = b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data
        head = self._head
        if head is not None:
            self._head = None
            frame = head + frame
        writer.send(frame)
        if writer.writing_paused:
            await writer.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        """The last piece, and the end of the body."""
        self._write_eof(data)

    def _write_eof(self, data: bytes = b"") -> None:
        if self._eof:
            return
        writer = self._writer
        if writer is None or self._request is None:
            raise RuntimeError("write_eof() before prepare()")
        self._eof = True
        out = self._head or b""
        self._head = None
        if not self._no_body:
            if self._chunked:
                if data:
                    out += b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)
                else:
                    out += _LAST_CHUNK
            elif data:
                out += data
        if out:
            writer.send(out)
        writer.finished(self._request)

    def _finish(self, request: Request) -> None:
        """After the handler: prepare (if it did not) and end the answer."""
        if self._writer is None:
            self._prepare(request)
        self._write_eof()


class Response(StreamResponse):
    """A whole answer, written in one write with its ``Content-Length``."""

    __slots__ = ("body",)

    def __init__(
        self,
        *,
        status: int = 200,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        content_type: str | None = None,
    ) -> None:
        super().__init__(status=status, headers=headers)
        self.body = body
        if content_type is not None:
            self.headers["Content-Type"] = content_type

    def _prepare(self, request: Request) -> None:
        if self._writer is not None:
            return
        if not (self.status < 200 or self.status in (204, 304)):
            self.headers["Content-Length"] = str(len(self.body))
        super()._prepare(request)

    async def write(self, data: bytes) -> None:
        raise RuntimeError("a Response is written whole: set its body, or use a StreamResponse")

    def _write_eof(self, data: bytes = b"") -> None:
        super()._write_eof(self.body)  # its length is in the head: never chunked


def json_response(
    data: Any, *, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    """``data`` as compact JSON, ``application/json``."""
    body = json.dumps(data, separators=(",", ":")).encode()
    resp = Response(status=status, body=body, headers=headers)
    if "Content-Type" not in resp.headers:
        resp.headers["Content-Type"] = "application/json"
    return resp
