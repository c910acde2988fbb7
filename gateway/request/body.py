"""Step 1 of the request path: the body, read once and checked for what routing needs.

Everything a client can send that the rest of the gateway could not handle stops here with a
400 (or 408, 413) in OpenAI's envelope; what passes is a JSON object of valid Unicode text
with a model name, or an audio endpoint's multipart form (``gateway.request.form``) with its file.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import TYPE_CHECKING, Any, Final

from backends.errors import BodyTimeout, BodyTooLarge, InvalidRequest
from gateway.http import Request
from gateway.request.form import Upload, form_doc, read_form

if TYPE_CHECKING:  # gateway.config.settings imports the limits, which use this module
    from gateway.config.settings import Settings


async def read_body(
    request: Request, settings: Settings, *, endpoint: str, form: bool
) -> tuple[bytes | Upload, dict[str, Any]]:
    """The body as it is forwarded (bytes, or a spooled upload, ``gateway.request.form``) and as the
    gateway reads it (a JSON endpoint's object; an audio form's fields). ``endpoint``: its name;
    ``form``: it takes a multipart form."""
    within = settings.client.body_timeout
    if not form:
        return await read_json_body(request, settings.max_body_bytes, within)
    upload = await read_form(request, settings.max_upload_bytes, within)
    if "file" not in upload.files:  # vLLM would refuse it too, after the upload
        upload.close()
        raise InvalidRequest(
            f"The {endpoint} endpoint needs the audio as a file part named `file`.",
            param="file",
        )
    return upload, form_doc(upload.fields)


async def read_json_body(
    request: Request, limit: int, within: float
) -> tuple[bytes, dict[str, Any]]:
    """The raw body (forwarded as is) and its parsed object; 400/408/413 on bad input."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"Request body is larger than the limit of {limit} bytes.")
    try:
        if request.content.is_eof():  # the whole body came with the head: no wait, no timer
            raw = await request.read()
        else:
            async with asyncio.timeout(within):
                raw = await request.read()
    except TimeoutError as exc:
        raise BodyTimeout(f"The request body did not arrive within {within:g}s.") from exc
    return raw, parse_json_object(raw)


# ``\uD800``-``\uDFFF`` escapes: JSON lets them stand alone, Unicode text (and UTF-8) does not.
_SURROGATE_ESCAPE: Final = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A body as a JSON object of valid Unicode text; ``InvalidRequest`` (400) otherwise.

    Everything a client can send that the rest of the gateway could not handle stops here:
    bytes that are not UTF-8 JSON, nesting deeper than Python's parser goes, lone surrogates
    (they cannot be encoded again: prompt hashing, logs, metrics), anything but an object.
    """
    if not raw:
        raise InvalidRequest(
            "The request body is empty; expected a JSON object.", code="invalid_json"
        )
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(
            f"We could not parse the JSON body of your request: {exc}.", code="invalid_json"
        ) from exc
    except RecursionError as exc:
        raise InvalidRequest(
            "The JSON body of your request is nested too deeply.", code="invalid_json"
        ) from exc
    if not isinstance(doc, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw) is not None:
        try:  # a valid pair was joined by the parser; a lone half was not
            json.dumps(doc, ensure_ascii=False).encode()
        except UnicodeEncodeError as exc:
            raise InvalidRequest(
                "The JSON body of your request holds a lone UTF-16 surrogate (\\uD800-\\uDFFF),"
                " which is not valid Unicode text.",
                code="invalid_json",
            ) from exc
    return doc


def with_field(doc: dict[str, Any], raw: bytes, name: str, value: Any) -> bytes:
    """The body with ``name: value`` added: appended to ``raw`` when ``doc`` lacks it, so a long
    prompt is not serialised again; else ``doc`` serialised with it."""
    body = raw.rstrip()
    if doc and name not in doc and body.endswith(b"}"):
        field = json.dumps({name: value}, separators=(",", ":")).encode()
        return body[:-1] + b"," + field[1:]
    return json.dumps({**doc, name: value}, separators=(",", ":")).encode()


def request_model(doc: dict[str, Any]) -> str:
    """The body's ``model``: a non-empty string, or ``InvalidRequest``."""
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest(
            "You must provide a model parameter (a non-empty string).", param="model"
        )
    return model
