"""Admin actions that reach every worker process (``serve --workers``, ``gateway.workers``).

Worker 0 serves the admin API. An action that changes how the gateway routes (policy and
weights, drain and undrain, aliases and rollbacks, reload) changes only the process that ran
it, so once it succeeded there it is sent, as it came (method, path, body, token), to every
other worker's private admin socket, marked with ``X-Gateway-Fanout`` so it goes no further.
The answer says how many workers applied it (``X-Gateway-Workers: 2/2``); a worker that
refused or could not be reached is logged (``admin_fanout_failed``). Actions on the backends
themselves (loading a LoRA adapter) run once, from worker 0, and are not sent on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from gateway.workers import APPLIED_HEADER, FANOUT_HEADER, ask_peer

log = structlog.get_logger("gateway.admin")

_ONCE: Final = ("/admin/lora/",)  # acts on the backends: once for the host, not per worker
_TIMEOUT_S: Final = 10.0


def fanout_middleware(peers: Sequence[Path]) -> Middleware:
    @web.middleware
    async def fanout(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        if (
            request.method in ("GET", "HEAD")
            or FANOUT_HEADER in request.headers
            or request.path.startswith(_ONCE)
            or not 200 <= response.status < 300
        ):
            return response
        body = await request.read()
        results = await asyncio.gather(*(_send(p, request, body) for p in peers))
        response.headers[APPLIED_HEADER] = f"{1 + sum(results)}/{1 + len(peers)}"
        return response

    return fanout


async def _send(socket: Path, request: web.Request, body: bytes) -> bool:
    headers = {FANOUT_HEADER: "1", "Authorization": request.headers.get("Authorization", "")}
    if request.content_type:
        headers["Content-Type"] = request.content_type
    answer = await ask_peer(
        socket, request.method, request.path_qs, within=_TIMEOUT_S, body=body, headers=headers
    )
    if isinstance(answer, str):
        why = answer
    elif 200 <= answer[0] < 300:
        return True
    else:
        why = f"status {answer[0]}: {answer[1][:200].decode(errors='replace')}"
    log.warning("admin_fanout_failed", socket=socket.name, path=request.path, error=why)
    return False
