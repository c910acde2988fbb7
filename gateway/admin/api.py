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
from typing import Final

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from redis.exceptions import RedisError

from backends.errors import FleetLogUnavailable, GatewayError, error_envelope
from gateway.admin import capacity, lora, rollouts
from gateway.admin.actions import ACTIONS
from gateway.admin.console import PUBLIC_PATHS, add_console_routes
from gateway.admin.context import Admin, admin_of, hand_in
from gateway.admin.fleet import add_fleet_routes, change_handler
from gateway.admin.lastknown import LastKnown
from gateway.admin.reload import describe_policy
from gateway.admin.replays import Replays
from gateway.admin.state import get_state
from gateway.admin.stats import stats_document
from gateway.admin.views import backend_view, latency_view
from gateway.observe.host_metrics import own_page
from gateway.observe.latency_metrics import latency_views
from gateway.request.services import Services
from policies import POLICY_NAMES

log = structlog.get_logger("gateway.admin.api")

SERVER_HEADER: Final = "llm-gateway"


async def server_header(_request: web.Request, response: web.StreamResponse) -> None:
    """Every answer says it is the gateway, not which Python and aiohttp versions run it."""
    response.headers["Server"] = SERVER_HEADER


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
            response = web.json_response(err.envelope(), status=err.status, headers=err.headers)
        except web.HTTPException as exc:  # no such route or method: said in our shape too
            if exc.status not in (404, 405):
                raise
            kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
            response = web.json_response(
                error_envelope(f"{exc.reason} ({request.method} {request.path})", kind),
                status=exc.status,
                headers={k: v for k, v in exc.headers.items() if k.lower() == "allow"},
            )
        except (RedisError, OSError, TimeoutError) as exc:  # Redis in trouble: said once
            admin_of(request).views.note_failure(str(exc) or type(exc).__name__)
            error = FleetLogUnavailable(
                "Redis, which the fleet shares, did not answer; nothing was changed by this "
                "call. Try again shortly.",
                retry_after=1,
            )
            response = web.json_response(error.envelope(), status=503, headers=error.headers)
        except Exception:  # a bug: its traceback logged, the answer in our shape all the same
            log.exception("admin_call_failed", method=request.method, path=request.path)
            error = GatewayError("The admin call failed inside the gateway (see its log).")
            response = web.json_response(error.envelope(), status=500)
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


async def list_backends(request: web.Request) -> web.Response:
    svc = admin_of(request).svc
    pool = svc.pool
    policy = svc.router.policy
    weights = policy.weights
    now = pool.now()
    latency = {v.backend: v for v in latency_views(svc.latency, pool)}
    views = []
    for b in pool.all():
        view = backend_view(b, now, pool.snapshot(b, now), weights)
        view["latency"] = latency_view(latency[b.id])
        views.append(view)
    return web.json_response({"policy": policy.name, "backends": views})


async def get_policy(request: web.Request) -> web.Response:
    """The running policy, and the names ``PUT /admin/policy`` accepts."""
    return web.json_response({**describe_policy(admin_of(request).svc), "policies": POLICY_NAMES})


async def get_stats(request: web.Request) -> web.Response:
    """The cumulative counters a console diffs between polls (``gateway.admin.stats``)."""
    registry = admin_of(request).svc.metrics.registry
    return web.json_response(stats_document(registry.collect(), time.time()))


async def list_aliases(request: web.Request) -> web.Response:
    rollout = admin_of(request).svc.rollout
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
    rollout = admin_of(request).svc.rollout
    return web.json_response(rollout.describe(request.match_info["alias"]))


async def kv_events(request: web.Request) -> web.Response:
    """Each backend's KV-event feed and what the index holds of its cache."""
    svc = admin_of(request).svc
    feeds, index = svc.kv_feeds, svc.kv_index
    stats = index.stats()
    out: dict[str, object] = {}
    for b in svc.pool.all():
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


def create_admin_app(svc: Services, token: str) -> web.Application:
    """The admin API on the gateway's services. Its changes go through the fleet's change log
    when there is one (Redis, or files for the workers of one host: ``gateway.admin.fleet``)."""
    app = web.Application(middlewares=[_token_middleware(token, PUBLIC_PATHS)])
    app.on_response_prepare.append(server_header)
    hand_in(app, Admin(svc, LastKnown(svc.settings.fleet.view_timeout), Replays()))
    add_console_routes(app)
    app.router.add_get("/admin/stats", get_stats)
    app.router.add_get("/admin/backends", list_backends)
    app.router.add_get("/admin/policy", get_policy)
    app.router.add_get("/admin/metrics", own_page(svc.metrics.registry))
    app.router.add_get("/admin/kv-events", kv_events)
    app.router.add_get("/admin/aliases", list_aliases)
    app.router.add_get("/admin/aliases/{alias}", get_alias)
    app.router.add_get("/admin/rollouts", rollouts.list_rollouts)
    app.router.add_get("/admin/rollouts/{alias}", rollouts.get_rollout)
    app.router.add_get("/admin/capacity", capacity.get_capacity)
    for action in ACTIONS:
        if action.routed:
            app.router.add_route(action.method, action.pattern, change_handler(action))
    add_fleet_routes(app)
    app.router.add_get("/admin/state", get_state)
    app.router.add_post("/admin/lora/load", lora.load_adapter)
    app.router.add_post("/admin/lora/unload", lora.unload_adapter)
    return app
