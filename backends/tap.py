"""A tap on an upstream response body: each body read is handed to a sink as it is parsed.

The usual way to read a body (``await response.content.readany()``) costs, per read, a
``StreamReader`` buffer round trip, a future and a task wake-up. On a token stream that is one
read per token, and it was most of the gateway's CPU. A tap removes all of it: aiohttp's own
(C) HTTP parser keeps decoding the framing, but the bytes it decodes go straight to
``sink.on_data`` inside the transport's ``data_received``, with no task involved.

How, on aiohttp's internals (pinned by ``tests/backends/test_tap.py``):

- the response's ``StreamReader`` is switched to ``_TapReader``, a subclass with the same slots
  whose ``feed_data`` / ``feed_eof`` / ``set_exception`` (called by the parser, by aiohttp on a
  lost connection, and by the idle watchdog) notify the sink; the reader buffers nothing.
- the connection's transport gets a thin protocol in front of aiohttp's ``ResponseHandler``
  that forwards everything to it and also reports what aiohttp does not pass on to the body: a
  framing error (a backend that lies in its chunk sizes) and a lost connection.
- all the HTTP chunks the parser decodes from one socket read reach the sink as one piece
  (one client write per read, as ``readany`` gave); flow control pauses the transport.

Taking over *after* aiohttp's parser (rather than parsing the raw socket bytes ourselves) means
no parser state is ever lost at the switch, and a completed response goes back to the keep-alive
pool as usual: the tap puts the original protocol back before aiohttp releases the connection.

Those internals are not aiohttp's public API, so ``pyproject.toml`` pins aiohttp to the minor
versions the tests cover, and ``internals_problem()`` checks at start-up that they are as this
module expects; when they are not, the gateway says so once and relays with plain reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from typing import Final, Protocol

import aiohttp
import aiohttp.helpers
from aiohttp.client_proto import ResponseHandler
from aiohttp.streams import StreamReader

# aiohttp's "no cause given" marker for set_exception (private; checked by internals_problem).
_EXC_SENTINEL: Final[BaseException] = getattr(aiohttp.helpers, "_EXC_SENTINEL", BaseException())


class StreamSink(Protocol):
    def on_data(self, data: bytes) -> bool:
        """One decoded body read; return True to stop reading until ``Tap.resume``."""

    def on_end(self) -> None:
        """The body is complete."""

    def on_error(self, exc: BaseException) -> None:
        """The body cannot complete (connection lost, bad framing, idle timeout...)."""


# The reader slots are aiohttp's; a tapped reader finds its tap here.
_TAPS: Final[dict[StreamReader, Tap]] = {}


class _TapReader(StreamReader):
    __slots__ = ()

    def feed_data(self, data: bytes, size: int = 0) -> bool:
        if data:
            _TAPS[self]._data(data)
        return False

    def begin_http_chunk_receiving(self) -> None:
        pass

    def end_http_chunk_receiving(self) -> None:
        pass

    def feed_eof(self) -> None:
        tap = _TAPS.get(self)
        if tap is not None:
            tap._end()
        # Not super(): the tap may have switched this reader back to a plain StreamReader.
        StreamReader.feed_eof(self)  # aiohttp's callbacks: the connection goes back to the pool

    def set_exception(self, exc: BaseException, exc_cause: BaseException = _EXC_SENTINEL) -> None:
        StreamReader.set_exception(self, exc, exc_cause)
        tap = _TAPS.get(self)
        if tap is not None:
            tap._error(exc)


class Tap(asyncio.Protocol):
    """An installed tap; ``close()`` it when done (idempotent), whatever the ending."""

    def __init__(
        self,
        reader: StreamReader,
        handler: ResponseHandler,
        transport: asyncio.Transport,
        sink: StreamSink,
    ) -> None:
        self._reader = reader
        self._handler = handler
        self._transport = transport
        self._sink = sink
        self._ended = False
        self._paused = False
        self._batch: list[bytes] | None = None  # the reads of one data_received
        self._held: list[bytes | BaseException | None] | None = None  # while installing

    @property
    def paused(self) -> bool:
        """Whether reading stopped at the sink's request."""
        return self._paused

    # -- the sink's side ---------------------------------------------------------------

    def resume(self) -> None:
        """Read again after the sink asked to stop."""
        if self._paused and not self._ended:
            self._paused = False
            with contextlib.suppress(RuntimeError):  # closing: connection_lost follows
                self._transport.resume_reading()

    def close(self) -> None:
        """Detach: the reader and the transport are aiohttp's again."""
        self._ended = True
        self._restore()

    # -- what the reader and the transport tell us ------------------------------------

    def _data(self, data: bytes) -> None:
        if self._batch is not None:
            self._batch.append(data)
        elif self._held is not None:
            self._held.append(data)
        else:
            self._deliver(data)

    def _deliver(self, data: bytes) -> None:
        if self._ended:
            return
        if self._sink.on_data(data) and not self._ended and not self._paused:
            # Only the transport stops: the parser has decoded the whole read already.
            self._paused = True
            with contextlib.suppress(RuntimeError):  # closing: connection_lost follows
                self._transport.pause_reading()

    def _flush(self) -> None:
        batch = self._batch
        if batch:
            self._batch = []
            self._deliver(batch[0] if len(batch) == 1 else b"".join(batch))

    def _end(self) -> None:
        if self._held is not None:
            self._held.append(None)
            return
        self._flush()
        self._restore()  # before aiohttp releases the connection to the pool
        if not self._ended:
            self._ended = True
            self._sink.on_end()

    def _error(self, exc: BaseException) -> None:
        if self._held is not None:
            self._held.append(exc)
            return
        self._flush()
        if not self._ended:
            self._ended = True
            self._sink.on_error(exc)

    def _check_handler(self) -> None:
        # aiohttp records a framing error on the handler, not on the body: report it here.
        exc = self._handler.exception()
        if exc is not None and not self._ended:
            self._error(exc)

    def _restore(self) -> None:
        if _TAPS.get(self._reader) is self:
            del _TAPS[self._reader]
            self._reader.__class__ = StreamReader
        if self._transport.get_protocol() is self:
            self._transport.set_protocol(self._handler)

    # -- asyncio.Protocol, in front of aiohttp's ResponseHandler -------------------------

    def data_received(self, data: bytes) -> None:
        # Every HTTP chunk of one socket read goes to the sink as one piece: one client write.
        self._batch = []
        try:
            self._handler.data_received(data)
            self._flush()
        finally:
            self._batch = None
        self._check_handler()

    def eof_received(self) -> bool | None:
        self._handler.eof_received()
        return None  # close the transport, as aiohttp's protocol does

    def connection_lost(self, exc: BaseException | None) -> None:
        self._handler.connection_lost(exc)
        if not self._ended:
            self._error(exc or aiohttp.ServerDisconnectedError())

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()

    # -- installation -----------------------------------------------------------------

    def _install(self) -> None:
        reader = self._reader
        self._held = []
        _TAPS[reader] = self
        reader.__class__ = _TapReader
        self._transport.set_protocol(self)
        try:
            # What aiohttp buffered before the switch (draining it may let the parser feed
            # more, which is held so that the sink sees everything in order).
            first = StreamReader.read_nowait(reader)
        except BaseException as exc:  # the body had failed already
            first = b""
            self._held.insert(0, exc)
        held, self._held = self._held, None
        self._batch = [first] if first else []
        try:
            for item in held:
                if isinstance(item, bytes):
                    self._batch.append(item)
                elif item is None:
                    self._end()
                else:
                    self._error(item)
            self._flush()
        finally:
            self._batch = None
        self._check_handler()


# What the tap calls or overrides, with the parameters it passes (``tests/backends/test_tap.py``
# exercises every one of them on the pinned aiohttp).
_READER_API: Final = {
    "feed_data": ("self", "data", "size"),
    "feed_eof": ("self",),
    "set_exception": ("self", "exc", "exc_cause"),
    "begin_http_chunk_receiving": ("self",),
    "end_http_chunk_receiving": ("self",),
    "read_nowait": ("self", "n"),
    "is_eof": ("self",),
    "exception": ("self",),
}
_HANDLER_API: Final = {
    "data_received": ("self", "data"),
    "eof_received": ("self",),
    "connection_lost": ("self", "exc"),
    "pause_writing": ("self",),
    "resume_writing": ("self",),
    "exception": ("self",),
}


def internals_problem(reader: type = StreamReader, handler: type = ResponseHandler) -> str | None:
    """What of aiohttp's internals the tap relies on is not as expected; None if all is.

    Checked: the reader's and the response handler's methods and their parameters, that the
    reader keeps its state in ``__slots__`` (so its class can be switched to ``_TapReader``
    and back), and aiohttp's ``_EXC_SENTINEL``.
    """
    for cls, api in ((reader, _READER_API), (handler, _HANDLER_API)):
        for name, params in api.items():
            method = getattr(cls, name, None)
            if method is None:
                return f"{cls.__name__}.{name} is missing"
            try:
                found = tuple(inspect.signature(method).parameters)
            except (TypeError, ValueError):
                return f"{cls.__name__}.{name} has no readable signature"
            if found != params:
                return f"{cls.__name__}.{name} takes {found}, the tap expects {params}"
    if "__slots__" not in vars(reader):
        return f"{reader.__name__} no longer declares __slots__"
    probe = type("_Probe", (reader,), {"__slots__": ()})
    try:
        instance: object = object.__new__(reader)
        instance.__class__ = probe
        instance.__class__ = reader
    except TypeError as exc:
        return f"{reader.__name__}'s class cannot be switched: {exc}"
    if not hasattr(aiohttp.helpers, "_EXC_SENTINEL"):
        return "aiohttp.helpers._EXC_SENTINEL is missing"
    return None


def installed() -> list[Tap]:
    """The taps now installed (for tests and debugging)."""
    return list(_TAPS.values())


def tap(response: aiohttp.ClientResponse, sink: StreamSink) -> Tap | None:
    """Hand the rest of ``response``'s body to ``sink``; None if it cannot be tapped.

    A body that has already ended or failed, whose connection is gone, or that aiohttp wraps
    (decompression), is not tapped: the caller reads it the usual way.
    """
    reader = response.content
    conn = response.connection
    if type(reader) is not StreamReader or conn is None:
        return None
    handler, transport = conn.protocol, conn.transport
    if handler is None or transport is None or reader.is_eof() or reader.exception() is not None:
        return None
    # A framing error aiohttp has already met is reported to the sink as soon as it is installed.
    t = Tap(reader, handler, transport, sink)
    t._install()
    return t
