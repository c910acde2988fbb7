"""The composition root: the gateway's services built once, in dependency order, and closed in
the other on exit (``open_gateway``).

What it yields (``gateway.request.services.Services``) is handed as it is to the data plane
(``gateway.request.routes``), the admin API (``gateway.admin.api``) and a worker's private
socket (``gateway.workers.private``)::

    async with open_gateway(settings) as svc:
        server = data_plane(svc)
        ...

The fleet's member, the rollouts' driver and the capacity manager are among the services and
act on them: what they call back reads ``svc``, bound before any of them starts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Tracer

from backends.circuit import CircuitPolicy
from backends.discovery import Resolver
from backends.health import HealthPolicy
from backends.pool import BackendPool
from backends.supervise import Supervisor
from backends.upstream.client import Transport
from gateway.admin.actions import ActionApplier
from gateway.admin.capacity import submit_sleep
from gateway.admin.reload import backend_specs
from gateway.admin.rollouts import start_configured, submit_decision
from gateway.capacity.book import CapacityBook
from gateway.capacity.wiring import capacity_manager, hold_for_wakes
from gateway.config.declared import build
from gateway.config.policies import build_policy, latency_config, weights_of
from gateway.config.settings import Settings
from gateway.config.source import ConfigSource, SettingsLoader
from gateway.fleet.member import Member
from gateway.fleet.wiring import describe_replica, member_settings, open_store, replica_figures
from gateway.limits.admission import AdmissionQueue
from gateway.limits.fairqueue import SaturationThresholds, fleet_saturated
from gateway.limits.limiter import open_limiter
from gateway.limits.retry_budget_redis import open_retry_budget
from gateway.observe.capacity_metrics import CapacityCollector
from gateway.observe.kv_metrics import KvEventsCollector
from gateway.observe.latency_metrics import LatencyCollector
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.retry_budget_metrics import RetryBudgetCollector
from gateway.observe.tracing import provider_from_settings, tracer_from
from gateway.reach import open_backends
from gateway.request.disagg import role_policies
from gateway.request.generate import Generations
from gateway.request.hedge import HedgeBudget
from gateway.request.responses import open_homes
from gateway.request.retry import RetryPolicy
from gateway.request.rollout import Rollout
from gateway.request.router import Router
from gateway.request.services import Lifecycle, Services
from gateway.request.slo import ChangeSignal
from gateway.rollouts.driver import Driver
from gateway.rollouts.probes import probe_pools
from gateway.rollouts.state import RolloutBook
from gateway.workers.shared_reads import ReadCache
from gateway.workers.supervisor import Worker
from policies import KvIndex, LatencyTracker

if TYPE_CHECKING:
    from gateway.tokenizer import Tokenizers


@contextlib.asynccontextmanager
async def open_gateway(
    settings: Settings,
    *,
    loader: SettingsLoader | None = None,
    resolver: Resolver | None = None,
    tracer_provider: TracerProvider | None = None,
    transport: Transport | None = None,
    worker: Worker | None = None,
) -> AsyncIterator[Services]:
    """The gateway's services, started; closed on exit, the last started first.

    ``loader`` re-reads the configuration for a reload (SIGHUP, ``POST /admin/reload``);
    ``resolver``, ``tracer_provider`` and ``transport`` (how backends are reached:
    ``backends.upstream.mock.MockTransport`` in tests) replace the real ones. ``worker``: this
    process is one of ``serve --workers``' (its in-flight counts shared).
    """
    s = settings
    async with contextlib.AsyncExitStack() as stack:
        supervisor = Supervisor()  # every background loop runs under it
        metrics = GatewayMetrics()
        metrics.watch_supervisor(supervisor)
        read_cache = ReadCache() if worker is not None else None
        pool = _pool(s, worker)
        kv_index = KvIndex(s.kv_events.capacity)
        latency = LatencyTracker(latency_config(s.latency), clock=pool.now, solve_ahead=True)
        tokenizers = _tokenizers(s)
        if tokenizers is not None:
            stack.callback(tokenizers.close)
        prefill, decode = role_policies(s, kv_index, latency)  # the role pools' own policies
        router = Router(
            pool,
            build_policy(s, s.policy, weights_of(s.weights), kv_index, latency),
            prefill=prefill,
            decode=decode,
            retry_after=s.retry_after_seconds,
        )
        rollout = Rollout.from_settings(s)  # model pools and aliases
        admission = _admission(s, pool)
        changes = ChangeSignal()  # wakes the requests waiting for their TTFT objective
        pool.on_change(changes.notify)
        limiter = await stack.enter_async_context(
            open_limiter(s.limits, retry_after=s.retry_after_seconds, supervisor=supervisor)
        )
        retry_budget = await stack.enter_async_context(open_retry_budget(s, supervisor))
        metrics.registry.register(RetryBudgetCollector(lambda: retry_budget))
        homes = open_homes(s.responses, s.limits.redis, worker.private_peers if worker else ())
        stack.push_async_callback(homes.close)
        tracer = _tracer(s, tracer_provider, stack)
        reach = await stack.enter_async_context(
            open_backends(
                s,
                pool,
                kv_index,
                metrics,
                supervisor,
                worker=worker,
                read_cache=read_cache,
                resolver=resolver,
                transport=transport,
            )
        )
        capacity = CapacityBook(enabled=s.capacity.enabled, rules=s.capacity.rules())
        rollouts = RolloutBook()
        config = ConfigSource(load=loader or (lambda: settings), current=settings)
        # What runs on the services: it acts on them, and they hold it.
        svc: Services  # bound below, before any of these runs
        store = await stack.enter_async_context(open_store(s, worker))
        member = None
        if store.changes is not None and store.registry is not None:
            member = Member(
                store.changes,
                store.registry,
                ActionApplier(lambda: svc),  # the admin changes of every replica, applied here
                member_settings(s, worker),
                lambda: describe_replica(svc),
                on_new_epoch=lambda: _restore_counts(svc),
            )
        driver = Driver(
            rollouts,
            lambda: replica_figures(svc),
            lambda alias, body: submit_decision(svc, alias, body),
            store.claims,
            every=s.rollout.drive_every,
            on_abort=lambda alias, verdict: metrics.rollout_aborted(alias, verdict.breaches),
            probe=lambda plan: probe_pools(plan, rollout.pools, pool, reach.upstream),
            configured=lambda: config.current.rollout_plans(),  # noqa: PLW0108 - reloads
            start=lambda plan: start_configured(svc, plan),
        )
        holds = hold_for_wakes(s, pool, capacity, rollout, lambda: svc.manager)
        manager = capacity_manager(
            s,
            pool=pool,
            book=capacity,
            claim=store.capacity_claim,
            submit=lambda backend, asleep, why, token: submit_sleep(
                svc, backend, asleep, why, token
            ),
            upstream=reach.upstream,
            metrics=metrics,
            rollout=rollout,
            holds=holds,
            member=member,
        )
        svc = Services(
            settings=s,
            config=config,
            lifecycle=Lifecycle(),
            metrics=metrics,
            tracer=tracer,
            pool=pool,
            upstream=reach.upstream,
            monitor=reach.monitor,
            kv_index=kv_index,
            kv_feeds=reach.feeds,
            latency=latency,
            tokenizers=tokenizers,
            router=router,
            rollout=rollout,
            retry=build(RetryPolicy, s.retry),
            retry_budget=retry_budget,
            hedges=HedgeBudget(),
            changes=changes,
            limiter=limiter,
            admission=admission,
            holds=holds,
            response_homes=homes,
            generations=Generations(),
            adapters={},
            rollouts=rollouts,
            capacity=capacity,
            fleet=member,
            driver=driver,
            manager=manager,
            worker=worker,
            read_cache=read_cache,
        )
        _watch(svc)
        # Last: the fleet's changes applied here before traffic, then the duties it leases.
        if member is not None:
            await member.start()
            stack.push_async_callback(member.stop)
        task = supervisor.spawn("rollout_driver", "rollout-driver", driver.run)
        stack.push_async_callback(_cancel, task)
        if manager is not None:
            task = supervisor.spawn("capacity_manager", "capacity-manager", manager.run)
            stack.push_async_callback(_cancel, task)
        yield svc


def _tracer(
    s: Settings, given: TracerProvider | None, stack: contextlib.AsyncExitStack
) -> Tracer | None:
    provider = given or provider_from_settings(s.tracing)
    if provider is not None and given is None:  # ours: shut down (its spans flushed) on exit
        stack.push_async_callback(asyncio.to_thread, provider.shutdown)
    return tracer_from(provider)


def _pool(s: Settings, worker: Worker | None) -> BackendPool:
    pool = BackendPool(
        backend_specs(s),
        shared=worker.table if worker is not None else None,
        stale_after=s.scrape.stale_after,
        retry_after=s.retry_after_seconds,
        health=build(HealthPolicy, s.health),
        circuit=build(CircuitPolicy, s.health, prefix="circuit_"),
    )
    for b in s.backends:
        if b.drain:
            pool.set_draining(b.id, True)
    return pool


def _tokenizers(s: Settings) -> Tokenizers | None:
    """The configured models' tokenizers (None without any: nothing is loaded then)."""
    if not s.tokenizers:
        return None
    from gateway.tokenizer import Tokenizers  # tokenizers and Jinja: loaded only when configured

    k = s.kv_events
    return Tokenizers.load(
        s.tokenizers,
        inline_chars=k.inline_chars,
        threads=k.tokenize_threads,
        max_pending=4 * k.tokenize_threads,
    )


def _admission(s: Settings, pool: BackendPool) -> AdmissionQueue | None:
    adm = s.limits.admission
    if not adm.enabled:
        return None
    thresholds = SaturationThresholds.from_settings(adm)

    def saturated() -> bool:
        now = pool.now()
        return fleet_saturated(
            [pool.snapshot(b, now) for b in pool.all() if pool.routable(b, now)], thresholds
        )

    queue = AdmissionQueue(
        saturated, max_size=adm.max_size, max_wait=adm.max_wait, retry_after=adm.retry_after
    )
    pool.on_change(queue.notify)  # a scrape or a request's end may free capacity
    return queue


def _watch(svc: Services) -> None:
    """The metrics' collectors of what the services hold (read at each scrape)."""
    m, pool, router, admission = svc.metrics, svc.pool, svc.router, svc.admission
    m.known_pools(svc.rollout.pairs())
    m.watch_backends(pool, lambda: router.policy, lambda: admission.waiting if admission else 0)
    feeds = svc.kv_feeds
    m.registry.register(
        KvEventsCollector(
            svc.kv_index, lambda: feeds.status if feeds is not None else None, lambda: router.policy
        )
    )
    m.registry.register(LatencyCollector(svc.latency, pool, lambda: router.policy))
    m.watch_limits(lambda: svc.limiter, admission)
    m.registry.register(
        CapacityCollector(
            pool, lambda: svc.holds, lambda: svc.manager, lambda: list(svc.capacity.rules)
        )
    )
    if (member := svc.fleet) is not None:
        m.watch_fleet(lambda: member)


async def _restore_counts(svc: Services) -> None:
    """The fleet's log was lost and healed (or a healed one adopted): the budgets' counts, kept
    on the same Redis, written back from what this replica last saw of them."""
    await svc.limiter.store.restore_counts()


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
