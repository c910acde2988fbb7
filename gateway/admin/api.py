"""The admin API: its own app on its own listener, and only with a bearer token.

Never open by default: without ``admin.token`` in the settings it is not served at all. The
operator's console (``gateway.admin.console``) is served on the same listener at ``/``: its assets
hold no data and are the only paths answered without the token. Every change made through the
API (a POST or PUT) is logged as ``admin_action`` with its outcome; a refused token is logged as
``admin_token_refused`` (never the token itself).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Collection
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backends.errors import GatewayError, InvalidRequest, NotFound, error_envelope
from backends.state import BackendState
from gateway.admin import lora
from gateway.admin.console import PUBLIC_PATHS, add_console_routes
from gateway.admin.fanout import CATCH_UP, CatchUp, fanout_middleware
from gateway.admin.reload import change_policy, describe_policy, reload_settings
from gateway.admin.stats import stats_document
from gateway.app import server_header
from gateway.keys import (
    ADMIN_JOURNAL,
    GATEWAY,
    KV_FEEDS,
    KV_INDEX,
    LATENCY,
    METRICS,
    POOL,
    ROUTER,
    WORKER,
)
from gateway.observe.latency_metrics import latency_views
from gateway.request.rollout import ROLLOUT
from policies import POLICY_NAMES, score
from policies.latency import BackendLatency

log = structlog.get_logger("gateway.admin.api")


def _token_middleware(token: str, public: Collection[str] = ()) -> Middleware:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method in ("GET", "HEAD") and request.path in public:
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            log.warning(
                "admin_token_refused",
                method=request.method,
                path=request.path,
                peer=request.remote,
                given="none" if not given else "wrong",
            )
            return web.json_response(
                error_envelope("A valid admin bearer token is required.", "authentication_error"),
                status=401,
            )
        error: GatewayError | None = None
        try:
            response = await handler(request)
        except GatewayError as err:
            error = err
            response = web.json_response(err.envelope(), status=err.status)
        if request.method not in ("GET", "HEAD"):  # a change (or an attempt at one)
            (log.warning if error else log.info)(
                "admin_action",
                method=request.method,
                path=request.path,
                peer=request.remote,
                status=response.status,
                **({"error": error.message} if error else {}),
            )
        return response

    return check


def backend_view(
    b: BackendState, now: float, snapshot: Any = None, weights: Any = None
) -> dict[str, object]:
    load = b.load
    return {
        "score": None if snapshot is None or weights is None else score(snapshot, weights),
        "id": b.id,
        "url": b.spec.url,
        "source": b.spec.source,
        "health": b.health.state.value,
        "health_error": b.health.last_error,
        "circuit": b.circuit.state.value,
        "draining": b.draining,
        "removed": b.removed,
        "models": sorted(b.models),
        # the host's (every worker's, ``serve --workers``) when the snapshot is at hand
        "in_flight": b.in_flight if snapshot is None else snapshot.in_flight,
        "queue_depth": load.waiting if load else None,
        "running": load.running if load else None,
        "kv_cache_usage": load.kv_cache_usage if load else None,
        "scrape_age_s": None if load is None else round(now - b.load_at, 3),
    }


def latency_view(v: BackendLatency) -> dict[str, object]:
    """What the latency tracker learned of one backend (``policies.latency``)."""
    return {
        "predicted_ttft_s": round(v.idle_ttft, 6),
        "predicted_itl_s": round(v.itl_now, 6),
        "ttft_fit": {k: round(c, 6) for k, c in v.ttft.items()},
        "itl_fit": {k: round(c, 6) for k, c in v.itl.items()},
        "weight": round(v.weight, 3),
        "observed": v.observed,
        "last_ttft_s": v.last_ttft,
        "ttft_mape": None if v.mape is None else round(v.mape, 4),
    }


async def list_backends(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    pool = gateway[POOL]
    policy = gateway[ROUTER].policy
    weights = policy.weights
    now = pool.now()
    latency = {v.backend: v for v in latency_views(gateway[LATENCY], pool)}
    views = []
    for b in pool.all():
        view = backend_view(b, now, pool.snapshot(b, now), weights)
        view["latency"] = latency_view(latency[b.id])
        views.append(view)
    return web.json_response({"policy": policy.name, "backends": views})


def _set_draining(draining: bool) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        pool = request.app[GATEWAY][POOL]
        backend_id = request.match_info["backend_id"]
        b = pool.get(backend_id)
        if b is None:
            raise NotFound(f"No backend {backend_id!r}.")
        was = b.draining
        pool.set_draining(backend_id, draining)
        log.info("backend_drain_changed", backend=backend_id, draining=draining, was=was)
        now = pool.now()
        return web.json_response(backend_view(b, now, pool.snapshot(b, now)))

    return handler


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError as exc:
        raise InvalidRequest("The body must be JSON.") from exc


async def put_policy(request: web.Request) -> web.Response:
    return web.json_response(change_policy(request.app[GATEWAY], await _json_body(request)))


async def get_policy(request: web.Request) -> web.Response:
    """The running policy, and the names ``PUT /admin/policy`` accepts."""
    return web.json_response({**describe_policy(request.app[GATEWAY]), "policies": POLICY_NAMES})


async def get_stats(request: web.Request) -> web.Response:
    """The cumulative counters a console diffs between polls (``gateway.admin.stats``)."""
    registry = request.app[GATEWAY][METRICS].registry
    return web.json_response(stats_document(registry.collect(), time.time()))


async def post_reload(request: web.Request) -> web.Response:
    result = reload_settings(request.app[GATEWAY])
    return web.json_response(
        {"applied": result.applied, "restart_required": result.restart_required}
    )


async def list_aliases(request: web.Request) -> web.Response:
    rollout = request.app[GATEWAY][ROLLOUT]
    return web.json_response(
        {
            "aliases": [rollout.describe(a) for a in sorted(rollout.aliases)],
            "pools": {
                p.name: {
                    "model": p.model,
                    "backends": sorted(p.backends),
                    "labels": dict(p.labels),
                    "drained": p.name in rollout.drained,
                }
                for p in rollout.pools.values()
            },
        }
    )


async def get_alias(request: web.Request) -> web.Response:
    rollout = request.app[GATEWAY][ROLLOUT]
    return web.json_response(rollout.describe(request.match_info["alias"]))


async def put_alias(request: web.Request) -> web.Response:
    rollout = request.app[GATEWAY][ROLLOUT]
    body = await _json_body(request)
    return web.json_response(rollout.set_weights(request.match_info["alias"], body))


async def rollback_alias(request: web.Request) -> web.Response:
    rollout = request.app[GATEWAY][ROLLOUT]
    return web.json_response(rollout.rollback(request.match_info["alias"]))


def _drain_pool(drained: bool) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        rollout = request.app[GATEWAY][ROLLOUT]
        return web.json_response(rollout.set_drained(request.match_info["pool"], drained))

    return handler


async def kv_events(request: web.Request) -> web.Response:
    """Each backend's KV-event feed and what the index holds of its cache."""
    gateway = request.app[GATEWAY]
    feeds, index = gateway[KV_FEEDS], gateway[KV_INDEX]
    stats = index.stats()
    out: dict[str, object] = {}
    for b in gateway[POOL].all():
        st = feeds.status.get(b.id) if feeds is not None else None
        cache = stats.get(b.id)
        out[b.id] = {
            "state": "not followed" if feeds is None else (st.state if st else "discovering"),
            "why": st.why if st else "",
            "exact": index.exact(b.id),
            "sources": [
                {"rank": s.rank, "endpoint": s.endpoint, "replay": s.replay, "topic": s.topic}
                for s in (st.sources if st else ())
            ],
            "wire_form": st.form if st else None,
            "batches": st.batches if st else 0,
            "events": dict(st.events) if st else {},
            "gaps": dict(st.gaps) if st else {},
            "problems": dict(st.problems) if st else {},
            "lag_s": None if st is None or st.lag_s is None else round(st.lag_s, 4),
            "blocks": cache.blocks if cache else 0,
            "block_size": cache.block_size if cache else None,
            "orphans": cache.orphans if cache else 0,
            "evicted": cache.evicted if cache else 0,
        }
    return web.json_response(
        {"following": feeds is not None, "capacity": index.capacity, "backends": out}
    )


async def admin_metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[GATEWAY][METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_admin_app(gateway: web.Application, token: str) -> web.Application:
    """The admin API on ``gateway``. With ``serve --workers``, changes go from worker 0 to
    every worker, in order, and a worker lacking some catches up (``gateway.admin.fanout``)."""
    middlewares = [_token_middleware(token, PUBLIC_PATHS)]
    worker = gateway.get(WORKER)
    if worker is not None:
        journal = gateway[ADMIN_JOURNAL]
        middlewares.append(fanout_middleware(journal, worker.peers, origin=worker.index == 0))
    app = web.Application(middlewares=middlewares)
    app.on_response_prepare.append(server_header)
    app[GATEWAY] = gateway
    if worker is not None:
        catch_up = app[CATCH_UP] = CatchUp(
            journal, worker.private_peers, worker.admin_socket(worker.index), token
        )

        async def stop_catching_up(_app: web.Application) -> None:
            await catch_up.close()

        app.on_cleanup.append(stop_catching_up)
    add_console_routes(app)
    app.router.add_get("/admin/stats", get_stats)
    app.router.add_get("/admin/backends", list_backends)
    app.router.add_get("/admin/policy", get_policy)
    app.router.add_put("/admin/policy", put_policy)
    app.router.add_post("/admin/reload", post_reload)
    app.router.add_get("/admin/metrics", admin_metrics)
    app.router.add_get("/admin/kv-events", kv_events)
    app.router.add_post("/admin/backends/{backend_id}/drain", _set_draining(True))
    app.router.add_post("/admin/backends/{backend_id}/undrain", _set_draining(False))
    app.router.add_get("/admin/aliases", list_aliases)
    app.router.add_get("/admin/aliases/{alias}", get_alias)
    app.router.add_put("/admin/aliases/{alias}", put_alias)
    app.router.add_post("/admin/aliases/{alias}/rollback", rollback_alias)
    app.router.add_post("/admin/pools/{pool}/drain", _drain_pool(True))
    app.router.add_post("/admin/pools/{pool}/undrain", _drain_pool(False))
    app.router.add_post("/admin/lora/load", lora.load_adapter)
    app.router.add_post("/admin/lora/unload", lora.unload_adapter)
    return app
