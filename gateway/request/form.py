"""A ``multipart/form-data`` body (vLLM's audio endpoints): read once, kept to send again.

An audio upload can be tens of megabytes, so it is neither held whole in memory nor parsed
into objects: its bytes stream from the client into a spool (memory up to ``SPOOL_MEMORY``,
a temporary file beyond it) while ``python-multipart``'s streaming parser picks out what the
gateway needs: the form's small text fields (``model``, ``stream``, ``prompt``...) and that a
file part is there. Each attempt on a backend then sends the spooled bytes as they came
(the client's boundary and parts untouched), so a request fails over before its first byte
like a JSON one. An alias that renames the model replaces that one field's bytes in flight.

Everything a client can send that the rest of the gateway could not handle stops here with a
400 (or 408, 413) in OpenAI's envelope.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import IO, Any, Final

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from backends.errors import BodyTimeout, BodyTooLarge, InvalidRequest
from gateway.http import Request

SPOOL_MEMORY: Final = 1024 * 1024  # bytes of a body kept in memory before the spool is a file
MAX_FIELD_BYTES: Final = 64 * 1024  # a text field's value (a prompt, a language...)
MAX_PARTS: Final = 64
_READ: Final = 256 * 1024  # bytes read (and sent) at a time
# Fields vLLM takes as integers: the limits count them as the JSON endpoints' numbers.
_INT_FIELDS: Final = frozenset({"max_completion_tokens", "max_tokens", "seed"})


@dataclass(slots=True)
class _Part:
    name: str | None = None
    filename: str | None = None
    value: bytearray = field(default_factory=bytearray)
    start: int = -1  # where the value's bytes begin in the body, and end
    end: int = -1
    size: int = 0


class FormScan:
    """What a multipart body holds, from its bytes fed in order (pure: no I/O).

    ``fields`` are its text parts' values (UTF-8), ``spans`` where each one's bytes are in the
    body, ``files`` the names of its file parts (a part with a ``filename``) and their sizes.
    """

    def __init__(self, boundary: bytes) -> None:
        self.fields: dict[str, str] = {}
        self.spans: dict[str, tuple[int, int]] = {}
        self.files: dict[str, int] = {}
        self.ended = False
        self._at = 0  # the body offset of the chunk being parsed
        self._part = _Part()
        self._parts = 0
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._begin,
                "on_header_field": self._header_field,
                "on_header_value": self._header_value_data,
                "on_header_end": self._header_end,
                "on_part_data": self._data,
                "on_part_end": self._end_part,
                "on_end": self._end,
            },
        )

    def feed(self, chunk: bytes) -> None:
        try:
            self._parser.write(chunk)
        except MultipartParseError as exc:
            raise InvalidRequest(
                f"We could not parse the multipart/form-data body of your request: {exc}.",
                code="invalid_multipart",
            ) from exc
        self._at += len(chunk)

    def finish(self) -> None:
        """The body is all in: it must have ended with its closing boundary."""
        if not self.ended:
            raise InvalidRequest(
                "The multipart/form-data body of your request ends before its closing boundary.",
                code="invalid_multipart",
            )

    # -- the parser's callbacks ---------------------------------------------------------------

    def _begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise InvalidRequest(
                f"The multipart/form-data body of your request has more than {MAX_PARTS} parts.",
                code="invalid_multipart",
            )
        self._part = _Part()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value_data(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if bytes(self._header_name).lower() == b"content-disposition":
            _, options = parse_options_header(bytes(self._header_value))
            name, filename = options.get(b"name"), options.get(b"filename")
            self._part.name = name.decode("utf-8", "replace") if name is not None else None
            self._part.filename = filename.decode("utf-8", "replace") if filename else None
        self._header_name.clear()
        self._header_value.clear()

    def _data(self, data: bytes, start: int, end: int) -> None:
        part = self._part
        if part.start < 0:
            part.start = self._at + start
        part.end = self._at + end
        part.size += end - start
        if part.filename is None:
            if part.size > MAX_FIELD_BYTES:
                raise InvalidRequest(
                    f"The form field `{part.name}` is longer than {MAX_FIELD_BYTES} bytes.",
                    param=part.name,
                    code="invalid_multipart",
                )
            part.value += data[start:end]

    def _end_part(self) -> None:
        part = self._part
        if part.name is None:
            raise InvalidRequest(
                "A part of the multipart/form-data body has no name (Content-Disposition).",
                code="invalid_multipart",
            )
        if part.filename is not None:
            self.files[part.name] = part.size
            return
        try:
            self.fields[part.name] = part.value.decode()
        except UnicodeDecodeError as exc:
            raise InvalidRequest(
                f"The form field `{part.name}` is not UTF-8 text.",
                param=part.name,
                code="invalid_multipart",
            ) from exc
        at = part.start if part.start >= 0 else part.end  # an empty value: where it would be
        self.spans[part.name] = (at, max(part.end, at))

    def _end(self) -> None:
        self.ended = True


def form_doc(fields: dict[str, str]) -> dict[str, Any]:
    """The form's fields as the JSON endpoints' body would hold them, for the limits and the
    policies: ``stream`` a bool, the integer fields integers."""
    doc: dict[str, Any] = dict(fields)
    if "stream" in doc:
        doc["stream"] = doc["stream"].strip().lower() in ("true", "1", "yes", "on")
    for name in _INT_FIELDS & doc.keys():
        value = doc[name].strip()
        doc[name] = int(value) if value.isdigit() else None
    return doc


class Upload:
    """A spooled multipart body: its size, its fields, and its bytes (``chunks``) for as many
    attempts as the request makes. ``close`` frees the spool."""

    def __init__(
        self,
        spool: IO[bytes],
        spooled: int,
        scan: FormScan,
        edits: tuple[tuple[int, int, bytes], ...] = (),
    ) -> None:
        self._spool = spool
        self._spooled = spooled
        self._scan = scan
        self._edits = edits  # (start, end, bytes): the spool's [start, end) sent as bytes
        self.size = spooled + sum(len(new) - (end - start) for start, end, new in edits)
        self.fields = dict(scan.fields)
        for start, end, new in edits:
            self.fields.update(
                (name, new.decode()) for name, span in scan.spans.items() if span == (start, end)
            )
        self.files = scan.files

    def replaced(self, name: str, value: str) -> Upload:
        """The same body with text field ``name``'s value replaced (its bytes, in flight)."""
        start, end = self._scan.spans[name]
        return Upload(self._spool, self._spooled, self._scan, ((start, end, value.encode()),))

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes from its start (each call a new pass over the spool)."""
        pos = 0
        for start, end, new in (*self._edits, (-1, -1, b"")):
            stop = start if start >= 0 else None
            async for chunk in self._range(pos, stop):
                yield chunk
            if start < 0:
                return
            yield new
            pos = end

    async def _range(self, pos: int, stop: int | None) -> AsyncIterator[bytes]:
        while stop is None or pos < stop:
            # Seeks every time: a pass cut short (an attempt that failed) leaves the position
            # anywhere, and the next pass starts its own.
            self._spool.seek(pos)
            want = _READ if stop is None else min(_READ, stop - pos)
            chunk = self._spool.read(want)
            if not chunk:
                return
            pos += len(chunk)
            yield chunk
            await asyncio.sleep(0)  # a large body does not hold up the loop between writes

    def close(self) -> None:
        self._spool.close()


def _boundary(request: Request) -> bytes:
    ctype, options = parse_options_header(request.headers.get("Content-Type", ""))
    boundary = options.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise InvalidRequest(
            "This endpoint expects a multipart/form-data body (with a boundary), as the OpenAI "
            f"SDK sends; got Content-Type `{request.headers.get('Content-Type', '')}`.",
            code="invalid_multipart",
        )
    return boundary


async def read_form(request: Request, limit: int, within: float) -> Upload:
    """The request's multipart body, spooled (``Upload``); 400/408/413 on bad input, with
    nothing kept."""
    boundary = _boundary(request)
    too_large = f"Request body is larger than the limit of {limit} bytes."
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(too_large)
    scan = FormScan(boundary)
    # Owned by the Upload returned (closed by the request path when it is done), or closed
    # here on the way out with an error.
    spool = tempfile.SpooledTemporaryFile(  # noqa: SIM115
        max_size=SPOOL_MEMORY, prefix="llm-gateway-upload-"
    )
    size = 0
    try:
        async with asyncio.timeout(within):
            async for chunk in request.content.iter_chunked(_READ):
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(too_large)
                spool.write(chunk)
                scan.feed(chunk)
        scan.finish()
    except TimeoutError as exc:
        spool.close()
        raise BodyTimeout(f"The request body did not arrive within {within:g}s.") from exc
    except BaseException:
        spool.close()
        raise
    return Upload(spool, size, scan)
