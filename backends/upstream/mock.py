"""An in-memory ``Transport``: a function answers each upstream request, no sockets involved.

httpx's ``MockTransport`` is the model. Tests of the logic above the transport (retries,
model pools, prefill then decode, the policy's outcomes) hand ``create_app`` one of these::

    async def vllm(request: MockRequest) -> MockResponse:
        if request.path == "/v1/models":
            return MockResponse.json({"object": "list", "data": [{"id": "m"}]})
        ...

    app = create_app(settings, transport=MockTransport(vllm))

A handler may raise ``OSError`` (e.g. ``ConnectionRefusedError``) to stand for a backend that
cannot be reached, and may stream its body from an async iterator (which may wait). The relay
and the tap, which need real sockets, keep their loopback tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from backends.state import BackendSpec
from backends.upstream.client import (
    CLIENT_ERRORS,
    HeadWait,
    Interrupt,
    RequestBody,
    Upstream,
    translate,
)
from backends.upstream.idle import IdleWatch


@dataclass(frozen=True, slots=True)
class MockRequest:
    backend: BackendSpec
    method: str
    path: str
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(slots=True)
class MockResponse:
    status: int = 200
    body: bytes | AsyncIterator[bytes] = b""
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, doc: Any, status: int = 200, **headers: str) -> MockResponse:
        body = json.dumps(doc).encode()
        return cls(status, body, {"Content-Type": "application/json", **headers})

    @classmethod
    def sse(cls, chunks: AsyncIterator[bytes], status: int = 200) -> MockResponse:
        return cls(status, chunks, {"Content-Type": "text/event-stream"})


MockHandler = Callable[[MockRequest], Awaitable[MockResponse]]


class _Body:
    """A response body read chunk by chunk; ``set_exception`` fails the reads (interrupt)."""

    __slots__ = ("_chunks", "_error", "_wake")

    def __init__(self, body: bytes | AsyncIterator[bytes]) -> None:
        self._chunks = _once(body) if isinstance(body, bytes) else body
        self._error: BaseException | None = None
        self._wake = asyncio.Event()

    async def readany(self) -> bytes:
        if self._error is not None:
            raise self._error
        step = asyncio.ensure_future(anext(self._chunks, b""))
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({step, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
        if step.done():
            return step.result()
        step.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await step
        assert self._error is not None
        raise self._error

    async def read(self, n: int = -1) -> bytes:
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def set_exception(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
            self._wake.set()


async def _once(body: bytes) -> AsyncIterator[bytes]:
    if body:
        yield body


class MockTransport:
    """Answers every request with ``handler``; records what was sent and how it ended."""

    def __init__(self, handler: MockHandler, *, idle_timeout: float = 5.0) -> None:
        self.handler = handler
        self.idle_timeout = idle_timeout
        self.requests: list[MockRequest] = []  # the POSTs (the request path's), in order
        self.finished: list[tuple[MockRequest, bool]] = []  # and whether each was complete
        self._sent: dict[int, MockRequest] = {}

    async def open(
        self,
        backend: BackendSpec,
        path: str,
        body: RequestBody,
        headers: Mapping[str, str],
        *,
        interrupt: Interrupt | None = None,
    ) -> Upstream:
        if not isinstance(body, bytes):  # what the real client would have sent, whole
            body = b"".join([chunk async for chunk in body.chunks()])
        request = MockRequest(backend, "POST", path, body, CIMultiDict(headers))
        self.requests.append(request)
        async with HeadWait(backend, interrupt, self.idle_timeout):
            response = await self.handler(request)
        content = _Body(response.body)
        if interrupt is not None:
            interrupt.watch(content)
        headers_out = CIMultiDictProxy(CIMultiDict(response.headers))
        ctype = headers_out.get("Content-Type", "application/octet-stream").split(";")[0].strip()
        upstream = Upstream(
            backend,
            response.status,
            headers_out,
            ctype,
            content,
            IdleWatch(lambda: None, 0.0),
            interrupt,
        )
        self._sent[id(upstream)] = request
        return upstream

    async def read_body(self, upstream: Upstream) -> bytes:
        try:
            return await upstream.content.read()
        except CLIENT_ERRORS as exc:
            raise translate(exc, upstream.backend) from exc

    def finish(self, upstream: Upstream, *, complete: bool) -> None:
        request = self._sent.pop(id(upstream), None)
        if request is not None:
            self.finished.append((request, complete))

    async def get(self, backend: BackendSpec, path: str, *, within: float) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(within):
                response = await self.handler(MockRequest(backend, "GET", path))
                body = await _Body(response.body).read()
        except CLIENT_ERRORS as exc:
            raise translate(exc, backend) from exc
        return response.status, body

    async def close(self) -> None:
        pass
