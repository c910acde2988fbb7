"""The application factory. Every long-lived resource is owned by a cleanup context."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from importlib import metadata
from typing import TYPE_CHECKING

import structlog
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.asyncio import Redis

from backends.circuit import CircuitPolicy
from backends.discovery import DnsDiscovery, Resolver
from backends.health import HealthPolicy
from backends.monitor import BackendMonitor, MonitorSettings, Reader
from backends.pool import BackendPool
from backends.shared_inflight import SharedInFlight
from backends.supervise import Supervisor
from backends.upstream.client import Transport, UpstreamClient
from gateway.admin.actions import ActionApplier
from gateway.admin.reload import CONFIG, ConfigSource, SettingsLoader, backend_specs
from gateway.admin.rollouts import start_configured, submit_decision
from gateway.capacity.book import CapacityBook
from gateway.capacity.wiring import capacity_ctx, capacity_parts
from gateway.config.declared import build
from gateway.config.policies import build_policy, latency_config, weights_of
from gateway.config.settings import Settings
from gateway.fleet.epoch import new_epoch
from gateway.fleet.figures import Figures
from gateway.fleet.figures import read as read_figures
from gateway.fleet.files import FileLog, FileRegistry
from gateway.fleet.lease import Lease
from gateway.fleet.log import ChangeLog, LogKeys, RedisLog
from gateway.fleet.member import Description, Member, MemberSettings, replica_id
from gateway.fleet.registry import RedisRegistry, Registry
from gateway.http import Request, Response, Routes
from gateway.keys import (
    ADAPTERS,
    ADMISSION,
    CAPACITY,
    CAPACITY_CLAIM,
    CLAIMS,
    DRIVER,
    FLEET,
    GATEWAY,
    GENERATIONS,
    HEDGES,
    HOLDS,
    KV_FEEDS,
    KV_INDEX,
    LATENCY,
    LIFECYCLE,
    LIMITER,
    MANAGER,
    METRICS,
    MONITOR,
    POOL,
    READ_CACHE,
    RESPONSE_HOMES,
    RETRY,
    RETRY_BUDGET,
    ROLLOUTS,
    ROUTER,
    ROUTES,
    SETTINGS,
    SUPERVISOR,
    TOKENIZERS,
    TRACER,
    UPSTREAM,
    WORKER,
    Lifecycle,
)
from gateway.limits.admission import AdmissionQueue
from gateway.limits.fairqueue import SaturationThresholds, fleet_saturated
from gateway.limits.limiter import open_limiter
from gateway.limits.retry_budget import LocalBudget, RetryBudgetPolicy
from gateway.limits.retry_budget_redis import RedisBudget
from gateway.observe import host_metrics
from gateway.observe.kv_metrics import KvEventsCollector
from gateway.observe.latency_metrics import LatencyCollector
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.retry_budget_metrics import RetryBudgetCollector
from gateway.observe.tracing import provider_from_settings, tracer_from
from gateway.request import info, proxy, stored
from gateway.request.aborts import ABORT_PATH, abort_requests
from gateway.request.disagg import role_policies
from gateway.request.endpoints import FORM_ENDPOINTS, JSON_ENDPOINTS, RESPONSES
from gateway.request.generate import Generations
from gateway.request.hedge import HedgeBudget
from gateway.request.responses import open_homes, peer_home
from gateway.request.retry import RetryPolicy
from gateway.request.rollout import ROLLOUT, Rollout
from gateway.request.router import Router
from gateway.request.services import hand_in
from gateway.request.slo import CHANGES, ChangeSignal
from gateway.rollouts.driver import Driver, Never, Sole
from gateway.rollouts.probes import probe_pools
from gateway.rollouts.state import RolloutBook
from gateway.workers.shared_reads import READ_PATH, ReadCache, SharedReads, read_handler
from gateway.workers.supervisor import Worker
from policies import KvIndex, LatencyTracker

if TYPE_CHECKING:
    from backends.kv.feed import KvFeeds
    from gateway.tokenizer import Tokenizers

log = structlog.get_logger("gateway.app")


async def _shutdown_tracing(provider: TracerProvider) -> None:
    await asyncio.to_thread(provider.shutdown)


def _pool(settings: Settings, shared: SharedInFlight | None) -> BackendPool:
    h = settings.health
    pool = BackendPool(
        backend_specs(settings),
        shared=shared,
        stale_after=settings.scrape.stale_after,
        retry_after=settings.retry_after_seconds,
        health=build(HealthPolicy, h),
        circuit=build(CircuitPolicy, h, prefix="circuit_"),
    )
    for b in settings.backends:
        if b.drain:
            pool.set_draining(b.id, True)
    return pool


def _reader(app: web.Application, client: Transport) -> Reader:
    """How the monitor reads the backends: itself, or with ``serve --workers`` through worker
    0's latest readings (``gateway.workers.shared_reads``)."""
    worker = app.get(WORKER)
    if worker is None:
        return client
    s, counter = app[SETTINGS], app[METRICS].monitor_reads
    labels = {"/health": "health", "/v1/models": "models", "/metrics": "metrics"}
    for read in labels.values():
        for source in ("backend", "worker0"):
            counter.labels(read, source)
    intervals = {
        "/health": s.health.interval,
        "/v1/models": s.health.interval,  # asked again when a backend comes back: fresh
        "/metrics": s.scrape.interval,
    }
    return SharedReads(
        client,
        app[READ_CACHE],
        None if worker.index == 0 else worker.private_socket(0),
        {path: 2 * interval for path, interval in intervals.items()},
        lambda path, source: counter.labels(labels.get(path, "other"), source).inc(),
    )


def _backends_ctx(resolver: Resolver | None, transport: Transport | None):  # type: ignore[no-untyped-def]
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        s = app[SETTINGS]
        pool = app[POOL]
        supervisor = app[SUPERVISOR]
        stall_after = s.health.stall_after

        def stalled(backend_id: str) -> None:
            error = f"stalled: none of its streams moved for {stall_after:g} s"
            if pool.record_stall(backend_id, error):
                app[METRICS].stalls.labels(backend_id).inc()
                log.warning("backend_stalled", backend=backend_id, stall_after_s=stall_after)

        client = transport or UpstreamClient(
            connect_timeout=s.upstream.connect_timeout,
            idle_timeout=s.upstream.idle_timeout,
            max_connections=s.upstream.max_connections,
            keepalive_timeout=s.upstream.keepalive_timeout,
            stall_after=stall_after,
            on_stall=stalled,
            supervisor=supervisor,
        )
        app[UPSTREAM] = client
        monitor = BackendMonitor(
            pool,
            _reader(app, client),
            MonitorSettings(
                scrape_interval=s.scrape.interval,
                scrape_timeout=s.scrape.timeout,
                models_interval=s.scrape.models_interval,
                probe_interval=s.health.interval,
                probe_timeout=s.health.timeout,
                sleep_probe=s.capacity.enabled,
                sleep_poll=s.capacity.sleep_poll,
            ),
            supervisor=supervisor,
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
            discovery_task = supervisor.spawn(
                "discovery", "discovery", lambda: discovery.run(d.interval)
            )
        await monitor.start(first_round_timeout=max(s.health.timeout, s.scrape.timeout))
        feeds = app[KV_FEEDS] = _kv_feeds(s, pool, app[KV_INDEX], client, supervisor)
        if feeds is not None:
            await feeds.start()
        try:
            yield
        finally:
            if feeds is not None:
                await feeds.stop()
            if discovery_task is not None:
                discovery_task.cancel()
                await asyncio.gather(discovery_task, return_exceptions=True)
            await monitor.stop()
            await client.close()

    return ctx


def _tokenizers(app: web.Application, settings: Settings) -> Tokenizers | None:
    """The configured models' tokenizers (None without any: nothing is loaded then)."""
    if not settings.tokenizers:
        return None
    from gateway.tokenizer import Tokenizers

    k = settings.kv_events
    tokenizers = Tokenizers.load(
        settings.tokenizers,
        inline_chars=k.inline_chars,
        threads=k.tokenize_threads,
        max_pending=4 * k.tokenize_threads,
    )

    async def close(_app: web.Application) -> None:
        tokenizers.close()

    app.on_cleanup.append(close)
    return tokenizers


def _kv_feeds(
    s: Settings, pool: BackendPool, index: KvIndex, client: Transport, supervisor: Supervisor
) -> KvFeeds | None:
    if not s.follows_kv_events:
        return None
    from backends.kv.feed import KvFeeds  # ZMQ is loaded only when events are followed
    from backends.kv.sources import FeedSettings

    return KvFeeds(pool, index, client, build(FeedSettings, s.kv_events), supervisor=supervisor)


def _admission(settings: Settings, pool: BackendPool) -> AdmissionQueue | None:
    adm = settings.limits.admission
    if not adm.enabled:
        return None
    thresholds = SaturationThresholds.from_settings(adm)

    def saturated() -> bool:
        now = pool.now()
        return fleet_saturated(
            [pool.snapshot(b, now) for b in pool.all() if pool.routable(b, now)], thresholds
        )

    return AdmissionQueue(
        saturated, max_size=adm.max_size, max_wait=adm.max_wait, retry_after=adm.retry_after
    )


async def _responses_ctx(app: web.Application) -> AsyncIterator[None]:
    """Where stored responses' homes are kept: this process, or the limits' Redis too."""
    s = app[SETTINGS]
    worker = app.get(WORKER)
    homes = open_homes(s.responses, s.limits.redis, worker.private_peers if worker else ())
    app[RESPONSE_HOMES] = homes
    yield
    await homes.close()


def _describe_replica(app: web.Application) -> Description:
    """What this replica tells the fleet's registry of itself: where it listens, its in-flight
    count and view of health per backend, and its figures since it started, read from the
    metrics and the limiter's counts as they stand (once per report, nothing per request)."""
    s, pool, metrics = app[SETTINGS], app[POOL], app[METRICS]
    backends = pool.all()
    limiter = app.get(LIMITER)
    families = [
        *metrics.requests.collect(),
        *metrics.ttft.collect(),
        *metrics.pool_requests.collect(),
        *metrics.pool_errors.collect(),  # the pools' figures a rollout's gates judge
        *metrics.pool_ttft.collect(),
        *metrics.pool_itl.collect(),
    ]
    return Description(
        address=f"{s.host}:{s.port}",
        in_flight={b.id: b.in_flight for b in backends},
        health={b.id: b.health.state.value for b in backends},
        figures=read_figures(families, limiter.rejections if limiter is not None else {}),
        driving=dict(app[DRIVER].progress) if DRIVER in app else {},
        held=dict(holds.held) if (holds := app[HOLDS]) is not None else {},
        capacity=manager.look if (manager := app[MANAGER]) is not None and manager.token else {},
    )


async def _fleet_ctx(app: web.Application) -> AsyncIterator[None]:
    """This replica (or worker) in its fleet: the admin changes of every replica and worker
    applied here, in the change log's order, before it takes traffic (``gateway.fleet``). The
    log is on Redis, or, for the workers of a host without it, in files."""
    s = app[SETTINGS]
    store = s.fleet_store
    if store is None:
        yield
        return
    f = s.fleet
    worker = app.get(WORKER)
    async with contextlib.AsyncExitStack() as stack:
        changes: ChangeLog
        registry: Registry
        if store == "redis":
            r = s.limits.redis
            redis = Redis.from_url(
                r.url.get_secret_value(),
                # Longer than the follower's blocking read (1 s), short enough that a Redis that
                # stopped answering (paused, overloaded) is noticed within a few seconds
                socket_timeout=2.5,
                socket_connect_timeout=2.0,
                max_connections=8,
            )
            stack.push_async_callback(redis.aclose)
            changes = RedisLog(redis, LogKeys.of(r.key_prefix, f.name), timeout=f.log_timeout)
            registry = RedisRegistry(redis, r.key_prefix, f.name, f.report_ttl)
            leases = f"{r.key_prefix}{f.name}:rollout-lease:"
            holder = replica_id(f.replica, None if worker is None else worker.index)
            ttl = s.rollout.lease_ttl
            app[CLAIMS] = lambda alias: Lease(redis, leases + alias, holder, ttl)
            app[CAPACITY_CLAIM] = Lease(
                redis, f"{r.key_prefix}{f.name}:capacity-lease", holder, s.capacity.lease_ttl
            )
        else:
            if f.dir is not None:
                directory = f.dir
            else:
                assert worker is not None, "Settings.unshared_changes refuses files without a dir"
                directory = worker.sockets / "fleet"
            changes = FileLog(directory, f.name)
            registry = FileRegistry(directory, f.name, f.report_ttl)
            if f.dir is None:  # the workers' own directory, new with them: nothing to heal
                await changes.establish(new_epoch())
            first = worker is None or worker.index == 0
            app[CLAIMS] = lambda _alias: Sole() if first else Never()  # one host: worker 0
            app[CAPACITY_CLAIM] = Sole() if first else Never()
        member = Member(
            changes,
            registry,
            ActionApplier(app),
            MemberSettings(
                fleet=f.name,
                replica=replica_id(f.replica, None if worker is None else worker.index),
                version=_version(),
                wait=f.wait,
                report_interval=f.report_interval,
                report_ttl=f.report_ttl,
                start_timeout=f.start_timeout,
                compact_every=f.compact_every,
                log_timeout=f.log_timeout,
            ),
            lambda: _describe_replica(app),
            on_new_epoch=lambda: _after_lost_log(app),
        )
        await member.start()
        stack.push_async_callback(member.stop)
        app[FLEET] = member
        app[METRICS].watch_fleet(lambda: member)
        yield


async def _after_lost_log(app: web.Application) -> None:
    """The log was lost and healed (or a healed one adopted): the budgets' counts, kept on the
    same Redis, are written back from what this replica last saw of them."""
    limiter = app.get(LIMITER)
    if limiter is not None:
        await limiter.store.restore_counts()


async def _rollouts_ctx(app: web.Application) -> AsyncIterator[None]:
    """The driver of progressive rollouts (``gateway.rollouts.driver``): on every replica, each
    rollout driven by the one holding its lease."""

    async def figures() -> dict[str, Figures]:
        member = app[FLEET]
        if member is None:
            return {"self": _describe_replica(app).figures}
        return {r.id: r.figures for r in await member.registry.replicas()}

    driver = Driver(
        app[ROLLOUTS],
        figures,
        lambda alias, body: submit_decision(app, alias, body),
        app[CLAIMS],
        every=app[SETTINGS].rollout.drive_every,
        on_abort=lambda alias, verdict: app[METRICS].rollout_aborted(alias, verdict.breaches),
        probe=lambda plan: probe_pools(plan, app[ROLLOUT].pools, app[POOL], app[UPSTREAM]),
        configured=lambda: app[CONFIG].current.rollout_plans(),  # noqa: PLW0108 - reloads
        start=lambda plan: start_configured(app, plan),
    )
    app[DRIVER] = driver
    task = app[SUPERVISOR].spawn("rollout_driver", "rollout-driver", driver.run)
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _version() -> str:
    try:
        return metadata.version("llm-gateway")
    except metadata.PackageNotFoundError:
        return "unknown"


async def _limits_ctx(app: web.Application) -> AsyncIterator[None]:
    s = app[SETTINGS]
    async with (
        open_limiter(
            s.limits, retry_after=s.retry_after_seconds, supervisor=app[SUPERVISOR]
        ) as limiter,
        _retry_budget(app),
    ):
        app[LIMITER] = limiter
        yield


@contextlib.asynccontextmanager
async def _retry_budget(app: web.Application) -> AsyncIterator[None]:
    """The budget of extra attempts: the fleet's, on the limits' Redis when they share one
    (its requests added in batches), else this replica's."""
    s = app[SETTINGS]
    policy = build(RetryBudgetPolicy, s.retry, prefix="budget_")
    budget: LocalBudget | RedisBudget
    if s.limits.store != "redis":
        budget = LocalBudget(policy, time.monotonic)
        app[RETRY_BUDGET] = budget
        app[METRICS].registry.register(RetryBudgetCollector(lambda: budget))
        yield
        return
    r = s.limits.redis
    client = Redis.from_url(
        r.url.get_secret_value(), socket_timeout=1.0, socket_connect_timeout=1.0, max_connections=4
    )
    budget = RedisBudget(
        client, policy, key_prefix=f"{r.key_prefix}{s.fleet.name}:", clock=time.monotonic
    )
    app[RETRY_BUDGET] = budget
    app[METRICS].registry.register(RetryBudgetCollector(lambda: budget))
    task = app[SUPERVISOR].spawn("retry_budget", "retry-budget", budget.run)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.aclose()


SERVER_HEADER = "llm-gateway"


async def server_header(_request: web.Request, response: web.StreamResponse) -> None:
    """Every answer says it is the gateway, not which Python and aiohttp versions run it."""
    response.headers["Server"] = SERVER_HEADER


async def metrics_endpoint(request: Request) -> Response:
    """This process's figures, or with ``serve --workers`` the host's (``host_metrics``)."""
    body = generate_latest(request.app[METRICS].registry)
    worker = request.app.get(WORKER)
    if worker is not None:
        texts = await host_metrics.gather(body.decode(), worker.private_peers)
        body = host_metrics.combine(texts)
    return Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def own_metrics(request: web.Request) -> web.Response:
    """A worker's own figures, on its private socket, for the worker that answers a scrape."""
    body = generate_latest(request.app[GATEWAY][METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def own_response_home(request: web.Request) -> web.Response:
    return await peer_home(request, request.app[GATEWAY][RESPONSE_HOMES])


def worker_private_app(gateway: web.Application) -> web.Application:
    """What a worker answers the other workers of its host (``serve --workers``), on its
    private socket: its own figures and the stored responses it knows the home of."""
    app = web.Application()
    app[GATEWAY] = gateway
    app.router.add_get("/metrics", own_metrics)
    app.router.add_get("/responses/home", own_response_home)
    if gateway[WORKER].index == 0:
        app.router.add_get(READ_PATH, read_handler(gateway[READ_CACHE]))
    return app


def _admin_state(app: web.Application) -> None:
    """What only admin changes move (the fleet's log, or this replica's admin API): LoRA
    adapters loaded, progressive rollouts."""
    app[FLEET] = None  # until the fleet's context joins it (``_fleet_ctx``)
    app[ADAPTERS] = {}
    app[ROLLOUTS] = RolloutBook()
    app[CLAIMS] = lambda _alias: Sole()  # one process drives its rollouts (a fleet: a lease)
    s = app[SETTINGS]
    app[CAPACITY] = CapacityBook(enabled=s.capacity.enabled, rules=s.capacity.rules())
    app[CAPACITY_CLAIM] = Sole()  # one process manages its capacity (a fleet: a lease)


def create_app(
    settings: Settings,
    *,
    resolver: Resolver | None = None,
    tracer_provider: TracerProvider | None = None,
    loader: SettingsLoader | None = None,
    transport: Transport | None = None,
    worker: Worker | None = None,
) -> web.Application:
    """The gateway app.

    ``loader`` re-reads the configuration for a reload (SIGHUP, ``POST /admin/reload``);
    ``resolver``, ``tracer_provider`` and ``transport`` (how backends are reached:
    ``backends.upstream.mock.MockTransport`` in tests) replace the real ones.
    ``worker``: this process is one of ``serve --workers``' (its in-flight counts shared).
    """
    # The services' container and their cleanup contexts; the model endpoints are served by
    # the gateway's own server (``gateway.http``, started in ``gateway.server``).
    app = web.Application()
    app[SETTINGS] = settings
    if worker is not None:
        app[WORKER] = worker
        app[READ_CACHE] = ReadCache()
    app[CONFIG] = ConfigSource(load=loader or (lambda: settings), current=settings)
    app[LIFECYCLE] = Lifecycle()
    app[HEDGES] = HedgeBudget()
    supervisor = app[SUPERVISOR] = Supervisor()  # every background loop runs under it
    pool = _pool(settings, worker.table if worker is not None else None)
    app[POOL] = pool
    kv_index = app[KV_INDEX] = KvIndex(settings.kv_events.capacity)
    tracker = app[LATENCY] = LatencyTracker(
        latency_config(settings.latency), clock=pool.now, solve_ahead=True
    )
    app[TOKENIZERS] = _tokenizers(app, settings)
    # The prefill and decode pools' own policies.
    prefill, decode = role_policies(settings, kv_index, tracker)
    app[ROUTER] = Router(
        pool,
        build_policy(settings, settings.policy, weights_of(settings.weights), kv_index, tracker),
        prefill=prefill,
        decode=decode,
        retry_after=settings.retry_after_seconds,
    )
    app[RETRY] = build(RetryPolicy, settings.retry)
    rollout = app[ROLLOUT] = Rollout.from_settings(settings)  # model pools and aliases
    admission = _admission(settings, pool)
    app[ADMISSION] = admission
    changes = app[CHANGES] = ChangeSignal()  # requests waiting for their TTFT objective
    pool.on_change(changes.notify)
    if admission is not None:
        pool.on_change(admission.notify)  # a scrape or a request's end may free capacity
    metrics = GatewayMetrics()
    metrics.known_pools(rollout.pairs())
    metrics.watch_backends(
        pool, lambda: app[ROUTER].policy, lambda: admission.waiting if admission else 0
    )
    metrics.registry.register(
        KvEventsCollector(
            kv_index,
            lambda: feeds.status if (feeds := app.get(KV_FEEDS)) is not None else None,
            lambda: app[ROUTER].policy,
        )
    )
    metrics.registry.register(LatencyCollector(tracker, pool, lambda: app[ROUTER].policy))
    metrics.watch_limits(lambda: app[LIMITER], admission)
    metrics.watch_supervisor(supervisor)
    app[METRICS] = metrics
    app.cleanup_ctx.append(_limits_ctx)
    app.cleanup_ctx.append(_responses_ctx)
    provider = tracer_provider or provider_from_settings(settings.tracing)
    app[TRACER] = tracer_from(provider)
    if provider is not None and tracer_provider is None:
        app.on_cleanup.append(lambda _: _shutdown_tracing(provider))
    app.cleanup_ctx.append(_backends_ctx(resolver, transport))
    _admin_state(app)
    capacity_parts(app, settings, pool, metrics)
    # Last: the fleet applies changes to all of the above; rollouts are driven through it, and
    # capacity managed.
    app.cleanup_ctx.extend((_fleet_ctx, _rollouts_ctx, capacity_ctx))
    _add_routes(app)
    app.on_startup.append(hand_in)  # after every cleanup context: the services they made
    return app


def _add_routes(app: web.Application) -> None:
    routes = app[ROUTES] = Routes()
    for endpoint in (*JSON_ENDPOINTS, *FORM_ENDPOINTS):
        for path in endpoint.paths:
            routes.add("POST", path, proxy.route_endpoint(endpoint))
    routes.add("POST", "/v1/responses", proxy.route_endpoint(RESPONSES))
    app[GENERATIONS] = Generations()  # the token-in generations the abort route finds
    routes.add("POST", ABORT_PATH, abort_requests)
    routes.add("GET", "/v1/responses/{response_id}", stored.get_response)
    routes.add("POST", "/v1/responses/{response_id}/cancel", stored.cancel_response)
    routes.add("GET", "/v1/models", info.list_models)
    routes.add("GET", "/health", info.health)
    routes.add("GET", "/ready", info.ready)
    routes.add("GET", "/metrics", metrics_endpoint)
