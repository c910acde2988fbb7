"""The request path: parse, pick, forward, relay, release. Read it top to bottom.

Every request holds at most one lease on a backend, released in one ``finally`` on every way
out: success, error, timeout and client disconnect (aiohttp cancels the handler when the
client goes away, because the server runs with ``handler_cancellation``). Closing the
upstream response early closes its connection, which is how vLLM learns to abort.
"""

from __future__ import annotations

import json
import time
from typing import Any

import structlog
from aiohttp import web

from backends.upstream import UpstreamClient
from gateway.errors import BodyTooLarge, InvalidRequest
from gateway.headers import downstream_headers, upstream_headers
from gateway.keys import REQUEST_ID_KEY, ROUTER, SETTINGS, UPSTREAM
from gateway.relay import Ending, relay_body, relay_stream
from policies import RouteFacts

log = structlog.get_logger("gateway.request")

_EVENT_STREAM = "text/event-stream"


async def read_json_body(request: web.Request, limit: int) -> tuple[bytes, dict[str, Any]]:
    """The raw body (forwarded as is) and its parsed object; 400/413 on bad input."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"Request body is larger than the limit of {limit} bytes.")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise BodyTooLarge(f"Request body is larger than the limit of {limit} bytes.") from exc
    if not raw:
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(
            f"We could not parse the JSON body of your request: {exc}.", code="invalid_json"
        ) from exc
    if not isinstance(doc, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    return raw, doc


def route_facts(doc: dict[str, Any]) -> RouteFacts:
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest(
            "You must provide a model parameter (a non-empty string).", param="model"
        )
    return RouteFacts(model=model)


async def forward(request: web.Request, path: str) -> web.StreamResponse:
    app = request.app
    settings = app[SETTINGS]
    started = time.monotonic()
    request_id: str = request[REQUEST_ID_KEY]
    raw, doc = await read_json_body(request, settings.max_body_bytes)
    facts = route_facts(doc)

    lease, candidates = app[ROUTER].pick(facts)
    backend = lease.backend.spec
    client: UpstreamClient = app[UPSTREAM]
    status = 0
    ending = "client_disconnect"
    first_token_at: float | None = None
    try:
        upstream = await client.open(
            backend, path, raw, upstream_headers(request.headers, request_id)
        )
        complete = False
        try:
            status = upstream.response.status
            headers = downstream_headers(upstream.response.headers, request_id)
            if upstream.response.content_type == _EVENT_STREAM:
                resp, result = await relay_stream(request, upstream, headers, time.monotonic)
                first_token_at = result.first_token_at
                complete = result.ending is Ending.COMPLETE
                ending = result.ending.value
            else:
                resp = await relay_body(upstream, headers, client)
                complete = True
                ending = "complete"
        finally:
            client.finish(upstream, complete=complete)
        return resp
    except Exception as exc:
        ending = type(exc).__name__
        raise
    finally:
        lease.release()
        log.info(
            "request",
            request_id=request_id,
            model=facts.model,
            backend=backend.id,
            status=status,
            ending=ending,
            ttft_ms=None if first_token_at is None else round((first_token_at - started) * 1e3, 2),
            duration_ms=round((time.monotonic() - started) * 1e3, 2),
            candidates=len(candidates),
        )


async def completions(request: web.Request) -> web.StreamResponse:
    return await forward(request, "/v1/completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await forward(request, "/v1/chat/completions")


async def list_models(request: web.Request) -> web.Response:
    pool = request.app[ROUTER].pool
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "llm-gateway"} for m in pool.models()
    ]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    pool = request.app[ROUTER].pool
    if pool.ready():
        return web.json_response({"status": "ready"})
    return web.json_response(
        {"status": "not ready", "reason": "no routable backend"},
        status=503,
        headers={"Retry-After": str(request.app[SETTINGS].retry_after_seconds)},
    )
