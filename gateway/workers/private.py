"""What a worker answers the other workers of its host (``serve --workers``) on its private
socket: its own figures (``gateway.observe.host_metrics``), the stored responses it knows the
home of (``gateway.request.responses``) and, worker 0's, its latest backend readings
(``gateway.workers.shared_reads``)."""

from __future__ import annotations

from aiohttp import web

from gateway.observe.host_metrics import own_page
from gateway.request.responses import peer_home
from gateway.request.services import Services
from gateway.workers.shared_reads import READ_PATH, read_handler


def private_app(svc: Services) -> web.Application:
    """The private socket's app for the worker ``svc`` are the services of."""
    worker, homes = svc.worker, svc.response_homes
    assert worker is not None, "a worker's services"

    async def home(request: web.Request) -> web.Response:
        return await peer_home(request, homes)

    app = web.Application()
    app.router.add_get("/metrics", own_page(svc.metrics.registry))
    app.router.add_get("/responses/home", home)
    if worker.index == 0 and svc.read_cache is not None:
        app.router.add_get(READ_PATH, read_handler(svc.read_cache))
    return app
