"""The application factory. Every long-lived resource is owned by a cleanup context."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web

from backends.circuit import CircuitPolicy
from backends.discovery import DnsDiscovery, Resolver
from backends.health import HealthPolicy
from backends.monitor import BackendMonitor, MonitorSettings
from backends.pool import BackendPool
from backends.state import BackendSpec
from backends.upstream import UpstreamClient
from gateway import proxy
from gateway.keys import LIFECYCLE, MONITOR, POOL, RETRY, ROUTER, SETTINGS, UPSTREAM, Lifecycle
from gateway.middleware import request_context
from gateway.retry import RetryPolicy
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


def _pool(settings: Settings) -> BackendPool:
    h = settings.health
    pool = BackendPool(
        backend_specs(settings),
        stale_after=settings.scrape.stale_after,
        retry_after=settings.retry_after_seconds,
        health=HealthPolicy(fall=h.fall, rise=h.rise),
        circuit=CircuitPolicy(
            threshold=h.circuit_threshold,
            cooldown=h.circuit_cooldown,
            growth=h.circuit_growth,
            max_cooldown=h.circuit_max_cooldown,
        ),
    )
    for b in settings.backends:
        if b.drain:
            pool.set_draining(b.id, True)
    return pool


def _backends_ctx(resolver: Resolver | None):  # type: ignore[no-untyped-def]
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        s = app[SETTINGS]
        pool = app[POOL]
        client = UpstreamClient(
            connect_timeout=s.upstream.connect_timeout,
            idle_timeout=s.upstream.idle_timeout,
            max_connections=s.upstream.max_connections,
        )
        app[UPSTREAM] = client
        monitor = BackendMonitor(
            pool,
            client,
            MonitorSettings(
                scrape_interval=s.scrape.interval,
                scrape_timeout=s.scrape.timeout,
                models_interval=s.scrape.models_interval,
                probe_interval=s.health.interval,
                probe_timeout=s.health.timeout,
            ),
        )
        app[MONITOR] = monitor
        discovery_task: asyncio.Task[None] | None = None
        if s.discovery.dns:

            def removed(backend_id: str) -> None:
                monitor.unwatch(backend_id)
                pool.remove(backend_id)

            d = s.discovery
            discovery = DnsDiscovery(
                d.dns,
                add=lambda spec: monitor.watch(pool.add(spec)),
                remove=removed,
                scheme=d.scheme,
                api_key=d.api_key.get_secret_value() if d.api_key else None,
                resolver=resolver,
            )
            await discovery.refresh()
            discovery_task = asyncio.create_task(discovery.run(d.interval), name="discovery")
        await monitor.start(first_round_timeout=max(s.health.timeout, s.scrape.timeout))
        try:
            yield
        finally:
            if discovery_task is not None:
                discovery_task.cancel()
                await asyncio.gather(discovery_task, return_exceptions=True)
            await monitor.stop()
            await client.close()

    return ctx


def create_app(settings: Settings, *, resolver: Resolver | None = None) -> web.Application:
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[request_context],
        handler_args={"max_field_size": 16 * 1024},
    )
    app[SETTINGS] = settings
    app[LIFECYCLE] = Lifecycle()
    pool = _pool(settings)
    app[POOL] = pool
    w = settings.weights
    app[ROUTER] = Router(
        pool,
        make_policy(settings.policy, Weights(active=w.active, queue=w.queue, kv=w.kv)),
        retry_after=settings.retry_after_seconds,
    )
    r = settings.retry
    app[RETRY] = RetryPolicy(
        max_attempts=r.max_attempts,
        deadline=r.deadline,
        backoff_base=r.backoff_base,
        backoff_max=r.backoff_max,
        backoff_factor=r.backoff_factor,
        jitter=r.jitter,
    )
    app.cleanup_ctx.append(_backends_ctx(resolver))
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat_completions)
    app.router.add_get("/v1/models", proxy.list_models)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/ready", proxy.ready)
    return app
