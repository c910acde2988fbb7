"""Aborting token-in generations by id (``POST /inference/v1/abort_requests``) on the backends
that run them.

vLLM names a ``/inference/v1/generate`` request after its ``X-Request-Id`` (the gateway sends
the client's, or the body's ``request_id`` when the client sent no header) and answers with
``generate-tokens-<that id>``; its abort route takes either. The gateway keeps, for each such
request in flight through this process, the ids it can be aborted by and who sent it
(``gateway.request.generate.Generations``); an abort goes to the backends the caller's own
requests are on. An id not in flight here is sent to every backend offering the route when
keys are off (another replica may be relaying it, and vLLM ignores ids it does not know), and
reported unknown when keys are on: no key aborts another's work. The answer says which ids
went where.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Final

from backends.errors import InvalidRequest, UpstreamError
from gateway.http import Request, Response, json_response
from gateway.keys import REQUEST_ID_KEY
from gateway.request.endpoints import GENERATE
from gateway.request.headers import upstream_headers
from gateway.request.services import Services

ABORT_PATH: Final = "/inference/v1/abort_requests"
_MAX_IDS: Final = 1024
_MAX_BODY: Final = 256 * 1024


def _ids_of(raw: bytes) -> list[str]:
    try:
        doc: Any = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest('The body must be JSON: {"request_ids": [...]}.') from exc
    ids = doc.get("request_ids") if isinstance(doc, dict) else None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise InvalidRequest(
            "`request_ids` must be a non-empty list of strings.", param="request_ids"
        )
    if len(ids) > _MAX_IDS:
        raise InvalidRequest(f"At most {_MAX_IDS} ids at a time.", param="request_ids")
    return list(dict.fromkeys(ids))


async def abort_requests(request: Request, svc: Services) -> Response:
    """``POST /inference/v1/abort_requests``: ``{"request_ids": [...]}`` aborted where they run."""
    principal = svc.limiter.authenticate(request.headers)
    raw = await request.content.read(_MAX_BODY + 1)
    if len(raw) > _MAX_BODY:
        raise InvalidRequest("The body is too large for a list of ids.")
    ids = _ids_of(raw)
    where, unknown = svc.generations.placed(ids, principal.id)
    pool = svc.router.pool
    if unknown and not principal.authenticated:  # keys off: anyone may abort anything
        offering = [b.id for b in pool.all() if GENERATE.name not in b.lacks]
        for backend in offering:
            where.setdefault(backend, []).extend(unknown)
        unknown = []
    headers = upstream_headers(request.headers, request[REQUEST_ID_KEY])

    async def send(backend: str, its: list[str]) -> tuple[str, str | None]:
        state = pool.get(backend)
        if state is None:
            return backend, "no longer in the fleet"
        client = svc.upstream
        body = json.dumps({"request_ids": its}).encode()
        try:
            upstream = await client.open(state.spec, ABORT_PATH, body, headers)
            try:
                answer = await client.read_body(upstream)
            finally:
                client.finish(upstream, complete=True)
        except UpstreamError as exc:
            return backend, exc.message
        if upstream.status != 200:
            return backend, f"{upstream.status}: {answer[:200].decode(errors='replace')}"
        return backend, None

    outcomes = await asyncio.gather(*(send(b, its) for b, its in where.items()))
    failed = {b: why for b, why in outcomes if why is not None}
    sent = {b: where[b] for b, why in outcomes if why is None}
    return json_response({"sent": sent, "failed": failed, "unknown": unknown})
