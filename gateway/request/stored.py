"""Stored responses of the Responses API: reaching the backend that holds one.

``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` go to the backend the gateway
remembered for that id (``gateway.request.responses``), as a request with ``previous_response_id``
does (``home_of``, used by ``gateway.request.proxy``). An id no backend is known to hold is a 404
(``response_not_found``), one whose backend left the fleet a 404 that says so
(``response_backend_gone``), one whose backend is there but cannot be reached now a 503 with
``Retry-After``. Keys and request limits apply; they are counted under the ``responses`` endpoint
like the requests that made them.
"""

from __future__ import annotations

import time
from typing import Any

from backends.errors import (
    InvalidRequest,
    NoBackendAvailable,
    ResponseBackendGone,
    ResponseNotFound,
)
from backends.state import BackendState
from gateway.http import Request, Response
from gateway.keys import REQUEST_ID_KEY
from gateway.request.headers import upstream_headers
from gateway.request.record import Ending, RequestOutcome, RequestRecord, finish
from gateway.request.services import Services

_TRUE = frozenset({"true", "1", "True"})


async def home_of(svc: Services, response_id: Any, param: str) -> str | None:
    """The backend holding ``response_id`` (None: none was named); raises if it is unknown,
    or its backend is gone."""
    if response_id is None:
        return None
    if not isinstance(response_id, str) or not response_id:
        raise InvalidRequest(f"`{param}` must be a non-empty string.", param=param)
    home = await svc.response_homes.home(response_id)
    if home is None:
        raise ResponseNotFound(f"Response with id '{response_id}' not found.", param=param)
    if svc.router.pool.get(home) is None:
        raise ResponseBackendGone(
            f"Response with id '{response_id}' was stored by backend {home}, which is no "
            "longer in the fleet: it is lost.",
            param=param,
        )
    return home


def _reachable(svc: Services, backend: str, response_id: str) -> BackendState:
    pool = svc.router.pool
    b = pool.get(backend)
    assert b is not None  # home_of checked
    if not pool.routable(b, pool.now()):
        raise NoBackendAvailable(
            f"The backend holding response '{response_id}' ({backend}) cannot be reached "
            "right now.",
            retry_after=svc.settings.retry_after_seconds,
        )
    return b


async def _to_home(request: Request, svc: Services, *, cancel: bool) -> Response:
    record = RequestRecord(request[REQUEST_ID_KEY], started=time.monotonic(), endpoint="responses")
    limiter, grant = svc.limiter, None
    outcome: RequestOutcome  # how it ended (``finish``)
    try:
        principal = limiter.authenticate(request.headers)
        record.key = principal.id
        if not cancel and request.query.get("stream") in _TRUE:
            raise InvalidRequest(
                "Streaming a stored response back (stream=true) is not supported through the "
                "gateway; ask for it whole.",
                param="stream",
            )
        grant = await limiter.admit(principal, {}, generates=False)
        rid = request.match_info["response_id"]
        home = await home_of(svc, rid, "response_id")
        assert home is not None
        backend = _reachable(svc, home, rid)
        record.backends.append(home)
        record.sent = True
        transport = svc.upstream
        if cancel:
            headers = upstream_headers(request.headers, record.request_id)
            upstream = await transport.open(backend.spec, request.path, b"", headers)
            try:
                body = await transport.read_body(upstream)
            finally:
                transport.finish(upstream, complete=True)
            status = upstream.status
        else:
            timeout = svc.settings.upstream.idle_timeout
            status, body = await transport.get(backend.spec, request.path_qs, within=timeout)
        record.status, outcome = status, Ending.COMPLETE
        return Response(status=status, body=body, content_type="application/json")
    except BaseException as exc:
        outcome = exc
        raise
    finally:
        if grant is not None:
            await limiter.finish(grant, 0)
        finish(svc, record, outcome)


async def get_response(request: Request, svc: Services) -> Response:
    """``GET /v1/responses/{id}``, answered by the backend that stored it."""
    return await _to_home(request, svc, cancel=False)


async def cancel_response(request: Request, svc: Services) -> Response:
    """``POST /v1/responses/{id}/cancel``, sent to the backend that runs it."""
    return await _to_home(request, svc, cancel=True)
