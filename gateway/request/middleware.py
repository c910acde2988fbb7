"""The data plane's entry: the request id in, the route found, errors out in OpenAI's envelope
(Anthropic's on ``/v1/messages``). The one place a ``GatewayError`` becomes a response."""

from __future__ import annotations

import uuid

import structlog

from backends.errors import GatewayError, ShuttingDown
from gateway.http import Handler, Request, Response, Routes, StreamResponse, json_response
from gateway.keys import REQUEST_ID_KEY
from gateway.request.dialects import OPENAI, Dialect, dialect_of
from gateway.request.headers import REQUEST_ID, valid_request_id
from gateway.request.services import Lifecycle

log = structlog.get_logger("backends.errors")


def error_response(err: GatewayError, dialect: Dialect = OPENAI) -> Response:
    return json_response(err.shaped(dialect.name), status=err.status, headers=err.headers)


def refusal_body(status: int, message: str, path: str | None) -> bytes:
    """The body of a request the server refuses before any handler (bad HTTP, a head too
    large or too slow), in the error shape of the endpoint it was for."""
    return (OPENAI if path is None else dialect_of(path)).refusal(status, message)


def entry(routes: Routes, lifecycle: Lifecycle) -> Handler:
    """The whole request path as the server calls it: it always answers, never raises
    (``/v1/`` refused once ``lifecycle`` says the gateway is stopping)."""

    async def handle(request: Request) -> Response | StreamResponse:
        request_id = valid_request_id(request.headers.get(REQUEST_ID)) or uuid.uuid4().hex
        request[REQUEST_ID_KEY] = request_id
        # Bind the request id for every log line of this request (structlog's contextvars),
        # then restore what was bound before: a connection's requests share its task. Tokens,
        # not ``bound_contextvars``, which copies the whole context to save and restore.
        bound = structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            resp = await _answer(request, routes, lifecycle)
        finally:
            structlog.contextvars.reset_contextvars(**bound)
        if not resp.prepared:
            resp.headers[REQUEST_ID] = request_id
        return resp

    return handle


async def _answer(
    request: Request, routes: Routes, lifecycle: Lifecycle
) -> Response | StreamResponse:
    try:
        handler, request.match_info = routes.resolve(request.method, request.path)
        if lifecycle.stopping and request.path.startswith("/v1/"):
            raise ShuttingDown("The gateway is shutting down; retry on another replica.")
        return await handler(request)
    except GatewayError as err:
        return error_response(err, dialect_of(request.path))
    except Exception:
        log.exception("unhandled_error", path=request.path)
        return error_response(
            GatewayError("The gateway failed to handle this request."), dialect_of(request.path)
        )
