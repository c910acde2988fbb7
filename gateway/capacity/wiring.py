"""Capacity's place in the gateway app (``gateway.app``'s composition): the requests held
for a wake and the metrics, made with the app; the manager, a cleanup context that runs after
the fleet's (its decisions go through the fleet's log)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Collection

from aiohttp import web

from backends.pool import BackendPool
from gateway.admin.capacity import submit_sleep
from gateway.capacity.hold import Holds
from gateway.capacity.manager import HttpEngines, Inputs, Manager
from gateway.capacity.settings import rule_of
from gateway.capacity.ttft import RecentTtft
from gateway.config.settings import Settings
from gateway.keys import (
    CAPACITY,
    CAPACITY_CLAIM,
    FLEET,
    HOLDS,
    MANAGER,
    METRICS,
    POOL,
    SETTINGS,
    SUPERVISOR,
    UPSTREAM,
)
from gateway.observe.capacity_metrics import CapacityCollector
from gateway.observe.metrics import GatewayMetrics
from gateway.request.rollout import ROLLOUT


async def capacity_ctx(app: web.Application) -> AsyncIterator[None]:
    """The capacity manager (``gateway.capacity.manager``): on every replica, turning on the one
    that holds its lease; off unless ``capacity.enabled``."""
    s = app[SETTINGS]
    if not s.capacity.enabled:
        yield
        return
    holds, member = app[HOLDS], app[FLEET]
    assert holds is not None

    async def held() -> dict[str, int]:
        total = Counter(holds.held)
        if member is not None:
            for report in await member.registry.replicas():
                if report.id != member.id:
                    total.update(report.held)
        return dict(total)

    c = s.capacity
    manager = Manager(
        app[POOL],
        app[CAPACITY],
        app[CAPACITY_CLAIM],
        submit=lambda backend, asleep, why, token: submit_sleep(app, backend, asleep, why, token),
        engines=HttpEngines(app[UPSTREAM], c.call_timeout),
        inputs=Inputs(
            held=held,
            ttft=RecentTtft(app[METRICS].ttft.collect).look,
            pools=lambda: {name: p.backends for name, p in app[ROLLOUT].pools.items()},
        ),
        every=c.every,
        # an engine going to sleep gets no /sleep before every replica has had the time to
        # apply the change that stopped their requests to it
        settle=0.0 if member is None else 2 * s.fleet.wait,
        trend_window=c.trend_window,
    )
    app[MANAGER] = manager
    task = app[SUPERVISOR].spawn("capacity_manager", "capacity-manager", manager.run)
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def capacity_parts(
    app: web.Application, settings: Settings, pool: BackendPool, metrics: GatewayMetrics
) -> None:
    """Capacity's parts the request path and the metrics read (the manager: ``_capacity_ctx``)."""
    app[HOLDS] = _holds(app, settings, pool)
    app[MANAGER] = None
    metrics.registry.register(
        CapacityCollector(
            pool, lambda: app[HOLDS], lambda: app[MANAGER], lambda: list(app[CAPACITY].rules)
        )
    )


def _holds(app: web.Application, settings: Settings, pool: BackendPool) -> Holds | None:
    """Requests held while an engine wakes (capacity on), each for its model's wake timeout."""
    c = settings.capacity
    if not c.enabled:
        return None
    default = rule_of(c.defaults)

    def timeout_of(group: str) -> float:
        return app[CAPACITY].rules.get(group, default).wake_timeout

    def wake(model: str, only: Collection[str] | None) -> None:
        manager = app[MANAGER]
        if manager is not None:
            manager.wake_for(model, only)

    def group(model: str, only: Collection[str] | None) -> str:
        """A request routed to a model pool is held for the pool (its rule, if it has one)."""
        if only is not None:
            for name, p in app[ROLLOUT].pools.items():
                if p.backends == only and name in app[CAPACITY].rules:
                    return name
        return model

    return Holds(pool, timeout_of, wake, retry_after=settings.retry_after_seconds, group=group)
