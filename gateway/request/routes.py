"""The data plane's routes: the model endpoints and the gateway's own, each handler closing
over the services it uses (``gateway.request.services``), made once at start-up."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from gateway.http import Request, Response, Routes
from gateway.observe.host_metrics import CONTENT_TYPE, page
from gateway.request import info, proxy, stored
from gateway.request.aborts import ABORT_PATH, abort_requests
from gateway.request.endpoints import ENDPOINTS, Endpoint
from gateway.request.services import Services


def model_routes(svc: Services, endpoints: Sequence[Endpoint] = ENDPOINTS) -> Routes:
    """The data plane's routes: ``endpoints`` (the table, ``gateway.request.endpoints``) and
    the gateway's own."""
    routes = Routes()
    for endpoint in endpoints:
        for path in endpoint.paths:
            routes.add("POST", path, proxy.route_endpoint(endpoint, svc))
    routes.add("POST", ABORT_PATH, partial(abort_requests, svc=svc))
    routes.add("GET", "/v1/responses/{response_id}", partial(stored.get_response, svc=svc))
    routes.add(
        "POST", "/v1/responses/{response_id}/cancel", partial(stored.cancel_response, svc=svc)
    )
    routes.add("GET", "/v1/models", partial(info.list_models, svc=svc))
    routes.add("GET", "/health", info.health)
    routes.add("GET", "/ready", partial(info.ready, svc=svc))
    routes.add("GET", "/metrics", partial(metrics, svc=svc))
    return routes


async def metrics(request: Request, svc: Services) -> Response:
    """This process's figures, or with ``serve --workers`` the host's (``host_metrics``)."""
    peers = svc.worker.private_peers if svc.worker is not None else None
    body = await page(svc.metrics.registry, peers)
    return Response(body=body, headers={"Content-Type": CONTENT_TYPE})
