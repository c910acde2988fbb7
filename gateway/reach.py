"""How the gateway reaches and watches its backends: the upstream client, the monitor (health,
load, models), DNS discovery and the KV-event feeds, opened in that order and closed in the
other (``open_backends``, one step of ``gateway.root``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from backends.discovery import DnsDiscovery, Resolver
from backends.monitor import BackendMonitor, MonitorSettings, Reader
from backends.pool import BackendPool
from backends.supervise import Supervisor
from backends.upstream.client import Transport, UpstreamClient
from gateway.config.declared import build
from gateway.config.settings import Settings
from gateway.observe.metrics import GatewayMetrics
from gateway.workers.shared_reads import ReadCache, SharedReads
from gateway.workers.supervisor import Worker
from policies.kv_index import KvIndex

if TYPE_CHECKING:
    from backends.kv.feed import KvFeeds

log = structlog.get_logger("gateway.reach")


@dataclass(frozen=True, slots=True)
class Reach:
    upstream: Transport
    monitor: BackendMonitor
    feeds: KvFeeds | None  # None: KV events not followed


@asynccontextmanager
async def open_backends(
    s: Settings,
    pool: BackendPool,
    index: KvIndex,
    metrics: GatewayMetrics,
    supervisor: Supervisor,
    *,
    worker: Worker | None = None,
    read_cache: ReadCache | None = None,
    resolver: Resolver | None = None,
    transport: Transport | None = None,
) -> AsyncIterator[Reach]:
    """The backends reached (``transport``, else the real client) and watched, their first
    round of reads done (bounded); everything closed on exit."""
    stall_after = s.health.stall_after

    def stalled(backend_id: str) -> None:
        error = f"stalled: none of its streams moved for {stall_after:g} s"
        if pool.record_stall(backend_id, error):
            metrics.stalls.labels(backend_id).inc()
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
    monitor = BackendMonitor(
        pool,
        _reader(s, client, metrics, worker, read_cache),
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
    feeds = _kv_feeds(s, pool, index, client, supervisor)
    if feeds is not None:
        await feeds.start()
    try:
        yield Reach(client, monitor, feeds)
    finally:
        if feeds is not None:
            await feeds.stop()
        if discovery_task is not None:
            discovery_task.cancel()
            await asyncio.gather(discovery_task, return_exceptions=True)
        await monitor.stop()
        await client.close()


def _reader(
    s: Settings,
    client: Transport,
    metrics: GatewayMetrics,
    worker: Worker | None,
    cache: ReadCache | None,
) -> Reader:
    """How the monitor reads the backends: itself, or with ``serve --workers`` through worker
    0's latest readings (``gateway.workers.shared_reads``)."""
    if worker is None or cache is None:
        return client
    counter = metrics.monitor_reads
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
        cache,
        None if worker.index == 0 else worker.private_socket(0),
        {path: 2 * interval for path, interval in intervals.items()},
        lambda path, source: counter.labels(labels.get(path, "other"), source).inc(),
    )


def _kv_feeds(
    s: Settings, pool: BackendPool, index: KvIndex, client: Transport, supervisor: Supervisor
) -> KvFeeds | None:
    if not s.follows_kv_events:
        return None
    from backends.kv.feed import KvFeeds  # ZMQ is loaded only when events are followed
    from backends.kv.sources import FeedSettings

    return KvFeeds(pool, index, client, build(FeedSettings, s.kv_events), supervisor=supervisor)
