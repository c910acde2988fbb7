"""Capacity's place in the gateway (``gateway.root``'s composition): the requests held for a
wake, and the manager, which decides through the fleet's log (``gateway.capacity.manager``).
Both only with ``capacity.enabled``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection

from backends.pool import BackendPool
from backends.upstream.client import Transport
from gateway.capacity.book import CapacityBook
from gateway.capacity.hold import Holds
from gateway.capacity.manager import HttpEngines, Inputs, Manager, Submit
from gateway.capacity.settings import rule_of
from gateway.capacity.ttft import RecentTtft
from gateway.config.settings import Settings
from gateway.fleet.member import Member
from gateway.observe.metrics import GatewayMetrics
from gateway.request.rollout import Rollout
from gateway.rollouts.driver import Claim


def hold_for_wakes(
    settings: Settings,
    pool: BackendPool,
    book: CapacityBook,
    rollout: Rollout,
    manager: Callable[[], Manager | None],
) -> Holds | None:
    """Requests held while an engine wakes, each for its model's wake timeout (``manager``:
    the one asked to wake it, made after)."""
    c = settings.capacity
    if not c.enabled:
        return None
    default = rule_of(c.defaults)

    def timeout_of(group: str) -> float:
        return book.rules.get(group, default).wake_timeout

    def wake(model: str, only: Collection[str] | None) -> None:
        m = manager()
        if m is not None:
            m.wake_for(model, only)

    def group(model: str, only: Collection[str] | None) -> str:
        """A request routed to a model pool is held for the pool (its rule, if it has one)."""
        if only is not None:
            for name, p in rollout.pools.items():
                if p.backends == only and name in book.rules:
                    return name
        return model

    return Holds(pool, timeout_of, wake, retry_after=settings.retry_after_seconds, group=group)


def capacity_manager(
    settings: Settings,
    *,
    pool: BackendPool,
    book: CapacityBook,
    claim: Claim,
    submit: Submit,
    upstream: Transport,
    metrics: GatewayMetrics,
    rollout: Rollout,
    holds: Holds | None,
    member: Member | None,
) -> Manager | None:
    """The capacity manager: on every replica, turning on the one that holds ``claim``."""
    c = settings.capacity
    if not c.enabled:
        return None
    assert holds is not None

    async def held() -> dict[str, int]:
        total = Counter(holds.held)
        if member is not None:
            for report in await member.registry.replicas():
                if report.id != member.id:
                    total.update(report.held)
        return dict(total)

    return Manager(
        pool,
        book,
        claim,
        submit=submit,
        engines=HttpEngines(upstream, c.call_timeout),
        inputs=Inputs(
            held=held,
            ttft=RecentTtft(metrics.ttft.collect).look,
            pools=lambda: {name: p.backends for name, p in rollout.pools.items()},
        ),
        every=c.every,
        # an engine going to sleep gets no /sleep before every replica has had the time to
        # apply the change that stopped their requests to it
        settle=0.0 if member is None else 2 * settings.fleet.wait,
        trend_window=c.trend_window,
    )
