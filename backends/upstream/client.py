"""The upstream client: the one place where errors talking to backends become gateway errors.

``Transport`` is the seam the request path and the monitors talk to (a ``Protocol``, as httpx's
transports are): ``UpstreamClient`` is the real one, on ``backends.upstream.h1``, and
``backends.upstream.mock`` an in-memory one for tests of the logic above it. ``open`` sends a
request and returns once the backend's status line and headers have arrived, as an ``Upstream``
whose body the caller reads; the caller must then ``finish`` it: back to the keep-alive pool after a
complete read, or closed otherwise, which is what makes vLLM abort a generation nobody is waiting
for.

Timeouts: connecting has its own; waiting for the response head is bounded by the idle timeout;
after that an ``IdleWatchdog`` cuts a body that stops moving (see ``backends.upstream.idle``). An
``Interrupt`` ends the wait at once when the request path says so, with the error it names (the
backend marked down, the first token later than the policy allows).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from multidict import CIMultiDict, CIMultiDictProxy

from backends.errors import (
    BackendStalled,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from backends.state import BackendSpec
from backends.supervise import Supervisor
from backends.upstream import h1
from backends.upstream.h1 import Broken
from backends.upstream.idle import IdleWatch, IdleWatchdog


class Ended(Broken):
    """Set on a response body whose wait the request path ended (``Interrupt.end``), with the
    error it named (its backend marked down, its first token late...)."""

    def __init__(self, error: UpstreamError) -> None:
        super().__init__(str(error))
        self.error = error


class Stalled(Broken):
    """Set on a response body whose backend stalled: none of its streams moved."""


class Idle(Broken):
    """Set on a response body that stopped moving for the idle timeout."""


def translate(exc: BaseException, backend: BackendSpec) -> UpstreamError:
    """Map an error from talking to ``backend`` onto the gateway's tree."""
    where = f"backend {backend.id}"
    if isinstance(exc, Ended):
        return exc.error
    if isinstance(exc, Stalled):
        return BackendStalled(f"{where}: stalled, none of its streams moved for {exc}")
    if isinstance(exc, h1.ConnectTimeout):
        return UpstreamUnreachable(f"{where}: connect timed out")
    if isinstance(exc, Idle | TimeoutError):
        return UpstreamTimeout(f"{where}: no data within the idle timeout")
    if isinstance(exc, h1.ConnectFailed):
        return UpstreamUnreachable(f"{where}: cannot connect ({exc})")
    if isinstance(exc, h1.CutShort):
        return UpstreamUnreachable(f"{where}: connection lost mid-answer")
    if isinstance(exc, h1.Disconnected | OSError):
        return UpstreamUnreachable(f"{where}: connection lost")
    if isinstance(exc, h1.BadFraming):
        return UpstreamProtocolError(f"{where}: malformed response")
    return UpstreamUnreachable(f"{where}: {type(exc).__name__}")


CLIENT_ERRORS = (Broken, TimeoutError, OSError)


class UpstreamBody(Protocol):
    """What the relay reads of a response body (``h1.UpstreamResponse`` is one)."""

    async def readany(self) -> bytes: ...

    async def read(self, n: int = -1) -> bytes: ...

    def set_exception(self, exc: BaseException) -> None: ...


class Replayable(Protocol):
    """A request body sent from where it is kept (a spooled upload), once per attempt:
    ``chunks`` starts a new pass over its ``size`` bytes each time it is called."""

    size: int

    def chunks(self) -> AsyncIterator[bytes]: ...


RequestBody = bytes | Replayable


class HedgeRace(Protocol):
    """Attempts racing for one client (a hedge): the first to claim it answers."""

    def claim(self, interrupt: Interrupt) -> bool:
        """``interrupt``'s attempt has its first bytes: True if it may send them to the
        client (the others are then ended with ``outrun``), False if another got there first."""


class Interrupt:
    """Ends an attempt's wait for its backend (head or first bytes) when the request path says
    so: ``end(error)``, the error naming why (the causes are the gateway's: its backend marked
    down, its first token late, a rival attempt answering first). ``after`` calls the request
    path back at a time of its choosing, unless the wait is over by then.

    Once anything is to be sent to the client it is taken (``take``): from then on the stream
    is the client's, and only the idle watchdog cuts it. With a ``race`` (attempts racing for
    one client), taking it is claiming the client.
    """

    __slots__ = ("_body", "_timer", "_wait", "armed", "cause", "race")

    def __init__(self, race: HedgeRace | None = None) -> None:
        self._wait: HeadWait | None = None
        self._body: UpstreamBody | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.armed = True
        self.cause: Ended | None = None  # set once ended
        self.race = race

    def end(self, error: UpstreamError) -> None:
        """End the wait (if it still is one) with ``error``."""
        if not self.armed or self.cause is not None:
            return
        cause = self.cause = Ended(error)
        if self._body is not None:
            self._body.set_exception(cause)
        elif self._wait is not None:
            self._wait.end(cause)

    def take(self) -> bool:
        """The attempt is about to send its first bytes to the client: disarm, and say whether
        it may (False: a rival attempt took the client first, and this one must end unsent)."""
        if self.race is not None and self.armed and not self.race.claim(self):
            return False
        self.disarm()
        return True

    def after(self, delay: float, callback: Callable[[float], None]) -> None:
        """Call ``callback(lag)`` ``delay`` seconds from now, unless disarmed first; ``lag``
        says how late the event loop ran it (a busy gateway, not its backend, may be what
        delayed the first bytes)."""
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + delay, self._due, callback)

    def _due(self, callback: Callable[[float], None]) -> None:
        timer, self._timer = self._timer, None
        lag = asyncio.get_running_loop().time() - timer.when() if timer is not None else 0.0
        if self.armed:
            callback(lag)

    def disarm(self) -> None:
        self.armed = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def watch(self, body: UpstreamBody) -> None:
        """The head has arrived: from now on an interrupt fails the body's reads."""
        self._body = body
        if self.cause is not None:  # ended as the head arrived: nothing was read yet
            body.set_exception(self.cause)


class HeadWait:
    """The wait for a response head (``async with``), ended at once by ``end(cause)``: from
    the interrupt, or from the idle watchdog (the real client) or a timer of ``within``
    seconds (``backends.upstream.mock``). Client and OS errors become the gateway's, and so does the
    cause (the error the request path named, ``UpstreamTimeout`` for a timeout...).

    No timer on the usual way: a head that comes costs no ``call_at`` and no cancellation.
    """

    __slots__ = ("_backend", "_cancelling", "_interrupt", "_task", "_timer", "cause")

    def __init__(
        self, backend: BackendSpec, interrupt: Interrupt | None, within: float | None = None
    ) -> None:
        self._backend = backend
        self._interrupt = interrupt
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._timer: asyncio.TimerHandle | None = None
        self.cause: Broken | None = None
        if within is not None:
            self._timer = asyncio.get_running_loop().call_later(
                within, self.end, Idle("idle timeout")
            )

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()
        if self._interrupt is not None:
            self._interrupt._wait = self

    def end(self, cause: Broken) -> None:
        """End the wait (if it still is one) with ``cause``."""
        task = self._task
        if task is None or self.cause is not None:
            return
        self.cause = cause
        task.cancel()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        task, self._task = self._task, None
        if self._timer is not None:
            self._timer.cancel()
        interrupt = self._interrupt
        if interrupt is not None:
            interrupt._wait = None
        cause = self.cause
        if cause is not None and task is not None:
            others = task.uncancel() > self._cancelling  # cancelled by someone else too
            if exc_type is asyncio.CancelledError and not others:
                raise translate(cause, self._backend) from exc
        if exc is not None and isinstance(exc, CLIENT_ERRORS):
            if interrupt is not None and interrupt.cause is not None:
                raise translate(interrupt.cause, self._backend) from exc
            raise translate(exc, self._backend) from exc


@dataclass(slots=True)
class Upstream:
    """A response whose head has arrived; ``watch.activity`` is bumped per body read.

    ``response`` is the HTTP client's own (which can be tapped), None from an in-memory
    transport.
    """

    backend: BackendSpec
    status: int
    headers: CIMultiDictProxy[str]
    content_type: str
    content: UpstreamBody
    watch: IdleWatch
    interrupt: Interrupt | None = None
    response: h1.UpstreamResponse | None = None


class Transport(Protocol):
    """How the gateway talks to backends: the request path's calls and the monitors' GETs."""

    async def open(
        self,
        backend: BackendSpec,
        path: str,
        body: RequestBody,
        headers: Mapping[str, str],
        *,
        interrupt: Interrupt | None = None,
    ) -> Upstream: ...

    async def read_body(self, upstream: Upstream) -> bytes: ...

    def finish(self, upstream: Upstream, *, complete: bool) -> None: ...

    async def get(self, backend: BackendSpec, path: str, *, within: float) -> tuple[int, bytes]: ...

    async def close(self) -> None: ...


class UpstreamClient:
    """The real ``Transport``: ``backends.upstream.h1``'s pooled HTTP/1.1 connections."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        idle_timeout: float,
        max_connections: int = 0,
        keepalive_timeout: float = 4.0,
        stall_after: float = 0.0,
        on_stall: Callable[[str], None] | None = None,
        supervisor: Supervisor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = h1.ConnectionPool(
            connect_timeout=connect_timeout,
            # Shorter than the backend's own (vLLM's uvicorn closes idle connections after 5 s):
            # reusing a connection the server is closing fails a request for nothing.
            keepalive_timeout=keepalive_timeout,
            limit=max_connections,
        )
        self.watchdog = IdleWatchdog(
            idle_timeout, stall_after=stall_after, on_stall=on_stall, clock=clock
        )
        self._watchdog_task = (supervisor or Supervisor()).spawn(
            "idle_watchdog", "idle-watchdog", self.watchdog.run
        )

    async def close(self) -> None:
        self._watchdog_task.cancel()
        await asyncio.gather(self._watchdog_task, return_exceptions=True)
        await self.pool.close()

    async def open(
        self,
        backend: BackendSpec,
        path: str,
        body: RequestBody,
        headers: Mapping[str, str],
        *,
        interrupt: Interrupt | None = None,
    ) -> Upstream:
        """POST ``body`` and return once the response head is in."""
        if backend.api_key:
            headers = CIMultiDict(headers)
            headers["Authorization"] = f"Bearer {backend.api_key}"
        wait = HeadWait(backend, interrupt)
        resp: h1.UpstreamResponse | None = None

        def on_idle() -> None:  # the idle watchdog bounds the head's wait as the body's
            stalled = watch.stalled
            cause = Stalled(f"{self.watchdog.stall_after:g} s") if stalled else Idle("idle timeout")
            if resp is None:
                wait.end(cause)
            else:
                resp.set_exception(cause)

        watch = self.watchdog.watch(on_idle, backend.id)
        try:
            async with wait:
                if isinstance(body, bytes):
                    resp = await self.pool.request("POST", backend.url, path, headers, body=body)
                else:  # sent as it is read, with its length (not chunked)
                    resp = await self.pool.request(
                        "POST", backend.url, path, headers, stream=body.chunks(), length=body.size
                    )
        except BaseException:
            self.watchdog.unwatch(watch)
            raise
        if interrupt is not None:
            interrupt.watch(resp)
        return Upstream(
            backend, resp.status, resp.headers, resp.content_type, resp, watch, interrupt, resp
        )

    async def read_body(self, upstream: Upstream) -> bytes:
        try:
            return await upstream.content.read()
        except CLIENT_ERRORS as exc:
            raise translate(exc, upstream.backend) from exc

    def finish(self, upstream: Upstream, *, complete: bool) -> None:
        """Return the connection to the pool after a complete read; close it otherwise."""
        self.watchdog.unwatch(upstream.watch)
        assert upstream.response is not None
        self.pool.release(upstream.response, complete=complete)

    async def get(self, backend: BackendSpec, path: str, *, within: float) -> tuple[int, bytes]:
        """A small GET for monitors, with its own overall timeout."""
        hdrs = {"Authorization": f"Bearer {backend.api_key}"} if backend.api_key else {}
        try:
            async with asyncio.timeout(within):
                resp = await self.pool.request("GET", backend.url, path, hdrs)
                done = False
                try:
                    body = await resp.read()
                    done = True
                finally:
                    self.pool.release(resp, complete=done)
                return resp.status, body
        except CLIENT_ERRORS as exc:
            raise translate(exc, backend) from exc


def json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None
