"""The gateway's own endpoints beside the routed API: the models it serves, and its probes.

``GET /v1/models`` is the union of the backends' models and the aliases; ``GET /health`` says
the process is alive; ``GET /ready`` that it can route (503 with ``Retry-After`` while it is
shutting down or has no routable backend: load balancers and Kubernetes take it out).
"""

from __future__ import annotations

from gateway.http import Request, Response, json_response
from gateway.request.services import Services


async def list_models(request: Request, svc: Services) -> Response:
    names = set(svc.pool.models()) | set(svc.rollout.names())
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "llm-gateway"} for m in sorted(names)
    ]
    return json_response({"object": "list", "data": data})


async def health(request: Request) -> Response:
    return json_response({"status": "ok"})


async def ready(request: Request, svc: Services) -> Response:
    if svc.lifecycle.stopping:
        reason = "shutting down"
    elif not svc.pool.ready():
        reason = "no routable backend"
    else:
        return json_response({"status": "ready"})
    return json_response(
        {"status": "not ready", "reason": reason},
        status=503,
        headers={"Retry-After": str(svc.settings.retry_after_seconds)},
    )
