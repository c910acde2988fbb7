"""The application factory. Every long-lived resource is owned by a cleanup context."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from backends.monitor import BackendMonitor, MonitorSettings
from backends.pool import BackendPool
from backends.state import BackendSpec
from backends.upstream import UpstreamClient
from gateway import proxy
from gateway.keys import MONITOR, POOL, ROUTER, SETTINGS, UPSTREAM
from gateway.middleware import request_context
from gateway.router import Router
from gateway.settings import Settings
from policies import Weights, make_policy


def backend_specs(settings: Settings) -> list[BackendSpec]:
    return [
        BackendSpec(
            id=b.id,
            url=b.url,
            api_key=b.api_key.get_secret_value() if b.api_key else None,
        )
        for b in settings.backends
    ]


async def _upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    s = app[SETTINGS]
    client = UpstreamClient(
        connect_timeout=s.upstream.connect_timeout,
        idle_timeout=s.upstream.idle_timeout,
        max_connections=s.upstream.max_connections,
    )
    app[UPSTREAM] = client
    monitor = BackendMonitor(
        app[POOL],
        client,
        MonitorSettings(
            scrape_interval=s.scrape.interval,
            scrape_timeout=s.scrape.timeout,
            models_interval=s.scrape.models_interval,
        ),
    )
    app[MONITOR] = monitor
    await monitor.start(first_round_timeout=s.scrape.timeout)
    try:
        yield
    finally:
        await monitor.stop()
        await client.close()


def create_app(settings: Settings) -> web.Application:
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[request_context],
        handler_args={"max_field_size": 16 * 1024},
    )
    app[SETTINGS] = settings
    pool = BackendPool(
        backend_specs(settings),
        stale_after=settings.scrape.stale_after,
        retry_after=settings.retry_after_seconds,
    )
    app[POOL] = pool
    w = settings.weights
    app[ROUTER] = Router(
        pool,
        make_policy(settings.policy, Weights(active=w.active, queue=w.queue, kv=w.kv)),
        retry_after=settings.retry_after_seconds,
    )
    app.cleanup_ctx.append(_upstream_ctx)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat_completions)
    app.router.add_get("/v1/models", proxy.list_models)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/ready", proxy.ready)
    return app
