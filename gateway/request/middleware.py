"""The one server middleware: request id in, errors out in OpenAI's envelope (Anthropic's on
``/v1/messages``)."""

from __future__ import annotations

import uuid

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from backends.errors import GatewayError, ShuttingDown, anthropic_envelope, error_envelope
from gateway.keys import LIFECYCLE, REQUEST_ID_KEY
from gateway.request.endpoints import Dialect, dialect_of
from gateway.request.headers import REQUEST_ID, valid_request_id

log = structlog.get_logger("backends.errors")

_HTTP_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
}


def error_response(err: GatewayError, dialect: Dialect = "openai") -> web.Response:
    return web.json_response(err.shaped(dialect), status=err.status, headers=err.headers)


@web.middleware
async def request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bind the request id for every log line of this request (structlog's contextvars)."""
    request_id = valid_request_id(request.headers.get(REQUEST_ID)) or uuid.uuid4().hex
    request[REQUEST_ID_KEY] = request_id
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        return await _answer(request, handler, request_id)


async def _answer(request: web.Request, handler: Handler, request_id: str) -> web.StreamResponse:
    try:
        if request.app[LIFECYCLE].stopping and request.path.startswith("/v1/"):
            raise ShuttingDown("The gateway is shutting down; retry on another replica.")
        resp = await handler(request)
    except GatewayError as err:
        resp = error_response(err, dialect_of(request.path))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and exc.text != exc.reason else exc.reason
        if exc.status in (404, 405):
            message = f"{message} ({request.method} {request.path})"
        resp = web.json_response(
            anthropic_envelope(exc.status, message)
            if dialect_of(request.path) == "anthropic"
            else error_envelope(
                message, _HTTP_ERROR_TYPES.get(exc.status, "invalid_request_error")
            ),
            status=exc.status,
            headers={k: v for k, v in exc.headers.items() if k.lower() == "allow"},
        )
    except Exception:
        log.exception("unhandled_error", path=request.path)
        resp = error_response(
            GatewayError("The gateway failed to handle this request."), dialect_of(request.path)
        )
    if not resp.prepared:
        resp.headers[REQUEST_ID] = request_id
    return resp
