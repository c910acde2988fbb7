"""The admin API: its own app on its own listener, and only with a bearer token.

Never open by default: without ``admin.token`` in the settings it is not served at all.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from backends.state import BackendState
from gateway.errors import GatewayError, error_envelope
from gateway.keys import GATEWAY, POOL, ROUTER


class AdminNotFound(GatewayError):
    status = 404
    type = "not_found_error"


def _token_middleware(token: str) -> Middleware:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return web.json_response(
                error_envelope("A valid admin bearer token is required.", "authentication_error"),
                status=401,
            )
        try:
            return await handler(request)
        except GatewayError as err:
            return web.json_response(err.envelope(), status=err.status)

    return check


def backend_view(b: BackendState, now: float) -> dict[str, object]:
    load = b.load
    return {
        "id": b.id,
        "url": b.spec.url,
        "source": b.spec.source,
        "health": b.health.state.value,
        "health_error": b.health.last_error,
        "circuit": b.circuit.state.value,
        "draining": b.draining,
        "removed": b.removed,
        "models": sorted(b.models),
        "in_flight": b.in_flight,
        "queue_depth": load.waiting if load else None,
        "running": load.running if load else None,
        "kv_cache_usage": load.kv_cache_usage if load else None,
        "scrape_age_s": None if load is None else round(now - b.load_at, 3),
    }


async def list_backends(request: web.Request) -> web.Response:
    pool = request.app[GATEWAY][POOL]
    now = pool.now()
    return web.json_response(
        {
            "policy": request.app[GATEWAY][ROUTER].policy.name,
            "backends": [backend_view(b, now) for b in pool.all()],
        }
    )


def _set_draining(draining: bool) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        pool = request.app[GATEWAY][POOL]
        backend_id = request.match_info["backend_id"]
        if not pool.set_draining(backend_id, draining):
            raise AdminNotFound(f"No backend {backend_id!r}.")
        b = pool.get(backend_id)
        assert b is not None
        return web.json_response(backend_view(b, pool.now()))

    return handler


def create_admin_app(gateway: web.Application, token: str) -> web.Application:
    app = web.Application(middlewares=[_token_middleware(token)])
    app[GATEWAY] = gateway
    app.router.add_get("/admin/backends", list_backends)
    app.router.add_post("/admin/backends/{backend_id}/drain", _set_draining(True))
    app.router.add_post("/admin/backends/{backend_id}/undrain", _set_draining(False))
    return app
