"""A request as the handlers see it: its head (``Request``) and its body as it arrives (``Body``).

The body is fed by the connection from the socket's read callback and read by the handler
task; nothing between them but a list of pieces. Flow control: past ``HIGH_WATER`` unread
bytes the connection stops reading the socket, and reads again once the handler has taken the
buffer below ``LOW_WATER``. A request sent with ``Expect: 100-continue`` is invited to send its
body only when the handler first waits for it, so a request refused on its head alone (401,
413 from its ``Content-Length``) never sends the body.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Hashable
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar, overload
from urllib.parse import parse_qsl, unquote, urlsplit

from multidict import CIMultiDictProxy, MultiDict, MultiDictProxy

from backends.errors import BodyTooLarge

if TYPE_CHECKING:
    from aiohttp.helpers import RequestKey

HIGH_WATER: Final = 256 * 1024  # unread body bytes before the socket is no longer read
LOW_WATER: Final = 64 * 1024  # ... and read again under this

_T = TypeVar("_T")


class Channel(Protocol):
    """The connection, as a request, its body and its response see it."""

    @property
    def transport(self) -> asyncio.Transport | None: ...

    def pause_body(self) -> None:
        """Stop reading the socket: a body's buffer is full."""

    def resume_body(self) -> None:
        """Read the socket again."""

    def send_continue(self) -> None:
        """Write ``100 Continue`` (the handler waits for a body the client holds back)."""


class Body:
    """The request body as it arrives; ``read``/``readany``/``iter_chunked`` as aiohttp's."""

    __slots__ = ("_buf", "_channel", "_continue", "_eof", "_exc", "_paused", "_size", "_waiter")

    def __init__(self, channel: Channel | None = None, *, expect_continue: bool = False) -> None:
        self._channel = channel
        self._continue = expect_continue
        self._buf: deque[bytes] = deque()
        self._size = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None

    # -- the connection's side -------------------------------------------------------

    def feed(self, data: bytes) -> None:
        if self._exc is not None:
            return
        self._buf.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER and not self._paused and self._channel is not None:
            self._paused = True
            self._channel.pause_body()
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._continue = False
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        """The body cannot complete (the client left, or broke the framing)."""
        if self._eof or self._exc is not None:
            return
        self._exc = exc
        self._wake()

    def release(self) -> None:
        """The request is done: drop what was not read, and let the socket be read again."""
        self._buf.clear()
        self._size = 0
        self._continue = False
        if self._paused:
            self._paused = False
            if self._channel is not None:
                self._channel.resume_body()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the handler's side ----------------------------------------------------------

    def is_eof(self) -> bool:
        """Whether the whole body has come (it may not have been read yet)."""
        return self._eof

    def at_eof(self) -> bool:
        """Whether the whole body has come and been read."""
        return self._eof and not self._buf

    async def _wait(self) -> None:
        """Until something is buffered, or the body ends or fails."""
        while not self._buf:
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return
            if self._continue:
                self._continue = False
                if self._channel is not None:
                    self._channel.send_continue()
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def _taken(self, n: int) -> None:
        self._size -= n
        if self._paused and self._size <= LOW_WATER:
            self._paused = False
            if self._channel is not None:
                self._channel.resume_body()

    async def readany(self) -> bytes:
        """What has come since the last read (at least a byte); b"" at the end."""
        if not self._buf:
            await self._wait()
            if not self._buf:
                return b""
        buf = self._buf
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        buf.clear()
        self._taken(len(data))
        return data

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (at least one, unless at the end); ``n`` < 0: all to the end."""
        if n < 0:
            parts = []
            while chunk := await self.readany():
                parts.append(chunk)
            return parts[0] if len(parts) == 1 else b"".join(parts)
        if n == 0:
            return b""
        if not self._buf:
            await self._wait()
            if not self._buf:
                return b""
        first = self._buf[0]
        if len(first) <= n:
            self._buf.popleft()
            data = first
        else:
            data, self._buf[0] = first[:n], first[n:]
        self._taken(len(data))
        return data

    async def iter_chunked(self, n: int) -> AsyncIterator[bytes]:
        """The body in pieces of at most ``n`` bytes."""
        while chunk := await self.read(n):
            yield chunk


def split_target(target: str) -> tuple[str, str]:
    """A request target's path (percent-decoded) and query string."""
    if target.startswith("/"):
        path, _, query = target.partition("?")
        if "#" in path:
            path = path.partition("#")[0]
        return unquote(path), query.partition("#")[0]
    if target == "*":
        return "*", ""
    parts = urlsplit(target)  # absolute form: http://host/path?query
    return unquote(parts.path or "/"), parts.query


class Request:
    """One request: its head, its body (``content``), the route's ``match_info``, and state
    the handlers keep on it (``request[key]``)."""

    __slots__ = (
        "_channel",
        "_max_body",
        "_query",
        "_query_string",
        "_read",
        "_state",
        "content",
        "content_length",
        "headers",
        "keep_alive",
        "match_info",
        "method",
        "path",
        "path_qs",
        "remote",
        "version",
    )

    def __init__(
        self,
        *,
        method: str,
        target: str,
        headers: CIMultiDictProxy[str],
        version: tuple[int, int],
        content: Body,
        channel: Channel | None = None,
        remote: str | None = None,
        max_body_bytes: int = 1 << 62,
        keep_alive: bool = True,
    ) -> None:
        self.method = method
        self.path_qs = target
        self.path, self._query_string = split_target(target)
        self._query: MultiDictProxy[str] | None = None
        self.headers = headers
        self.version = version
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None else None
        self.content = content
        self.match_info: dict[str, str] = {}
        self.remote = remote
        self.keep_alive = keep_alive  # as the client asked (the connection may still close)
        self._channel = channel
        self._max_body = max_body_bytes
        self._read: bytes | None = None
        self._state: dict[Hashable, Any] = {}

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.path_qs}>"

    @property
    def query(self) -> MultiDictProxy[str]:
        if self._query is None:
            pairs = parse_qsl(self._query_string, keep_blank_values=True)
            self._query = MultiDictProxy(MultiDict(pairs))
        return self._query

    @property
    def transport(self) -> asyncio.Transport | None:
        """The client's transport; None once the connection is lost."""
        return self._channel.transport if self._channel is not None else None

    async def read(self) -> bytes:
        """The whole body; ``BodyTooLarge`` past the server's ``max_body_bytes``."""
        if self._read is not None:
            return self._read
        limit = self._max_body
        too_large = f"Request body is larger than the limit of {limit} bytes."
        if self.content_length is not None and self.content_length > limit:
            raise BodyTooLarge(too_large)
        parts = []
        size = 0
        while chunk := await self.content.readany():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(too_large)
            parts.append(chunk)
        self._read = parts[0] if len(parts) == 1 else b"".join(parts)
        return self._read

    # -- per-request state, as aiohttp's (keys: web.RequestKey, or anything hashable) ----

    @overload
    def __getitem__(self, key: RequestKey[_T]) -> _T: ...

    @overload
    def __getitem__(self, key: Hashable) -> Any: ...

    def __getitem__(self, key: Hashable) -> Any:
        return self._state[key]

    def __setitem__(self, key: Hashable, value: Any) -> None:
        self._state[key] = value

    def __delitem__(self, key: Hashable) -> None:
        del self._state[key]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._state

    @overload
    def get(self, key: RequestKey[_T], default: None = None) -> _T | None: ...

    @overload
    def get(self, key: RequestKey[_T], default: _T) -> _T: ...

    @overload
    def get(self, key: Hashable, default: Any = None) -> Any: ...

    def get(self, key: Hashable, default: Any = None) -> Any:
        return self._state.get(key, default)
