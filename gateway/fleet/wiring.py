"""The fleet's place in the gateway (``gateway.root``'s composition): where its change log and
registry are kept (Redis, or files for the workers of a host without it), the leases of the
duties one replica holds for all (a rollout's driving, capacity's managing), and what this
replica tells the registry of itself."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

from redis.asyncio import Redis

from gateway.config.settings import Settings
from gateway.fleet.epoch import new_epoch
from gateway.fleet.figures import Figures
from gateway.fleet.figures import read as read_figures
from gateway.fleet.files import FileLog, FileRegistry
from gateway.fleet.lease import DutyLease
from gateway.fleet.log import ChangeLog, LogKeys, RedisLog
from gateway.fleet.member import Description, MemberSettings, replica_id
from gateway.fleet.registry import RedisRegistry, Registry
from gateway.rollouts.driver import Claim, Never, Sole
from gateway.workers.supervisor import Worker

if TYPE_CHECKING:
    from gateway.request.services import Services


@dataclass(frozen=True, slots=True)
class Store:
    """The fleet's log and registry (None: no fleet, this replica acts alone), and the leases:
    a rollout's by alias, the capacity manager's."""

    changes: ChangeLog | None
    registry: Registry | None
    claims: Callable[[str], Claim]
    capacity_claim: Claim


@contextlib.asynccontextmanager
async def open_store(s: Settings, worker: Worker | None) -> AsyncIterator[Store]:
    """The fleet's store as ``fleet.log`` says (``Settings.fleet_store``), closed on exit."""
    store, f = s.fleet_store, s.fleet
    holder = replica_id(f.replica, None if worker is None else worker.index)
    if store is None:  # one process drives its rollouts and manages its capacity
        yield Store(None, None, lambda _alias: Sole(), Sole())
    elif store == "redis":
        r = s.limits.redis
        redis = Redis.from_url(
            r.url.get_secret_value(),
            # Longer than the follower's blocking read (1 s), short enough that a Redis that
            # stopped answering (paused, overloaded) is noticed within a few seconds
            socket_timeout=2.5,
            socket_connect_timeout=2.0,
            max_connections=8,
        )
        leases, ttl = f"{r.key_prefix}{f.name}:rollout-lease:", s.rollout.lease_ttl
        try:
            yield Store(
                RedisLog(redis, LogKeys.of(r.key_prefix, f.name), timeout=f.log_timeout),
                RedisRegistry(redis, r.key_prefix, f.name, f.report_ttl),
                lambda alias: DutyLease(redis, leases + alias, holder, ttl),
                DutyLease(
                    redis, f"{r.key_prefix}{f.name}:capacity-lease", holder, s.capacity.lease_ttl
                ),
            )
        finally:
            await redis.aclose()
    else:
        if f.dir is not None:
            directory = f.dir
        else:
            assert worker is not None, "Settings.unshared_changes refuses files without a dir"
            directory = worker.sockets / "fleet"
        changes = FileLog(directory, f.name)
        if f.dir is None:  # the workers' own directory, new with them: nothing to heal
            await changes.establish(new_epoch())
        first = worker is None or worker.index == 0  # one host: worker 0 holds every duty
        yield Store(
            changes,
            FileRegistry(directory, f.name, f.report_ttl),
            lambda _alias: Sole() if first else Never(),
            Sole() if first else Never(),
        )


def member_settings(s: Settings, worker: Worker | None) -> MemberSettings:
    f = s.fleet
    return MemberSettings(
        fleet=f.name,
        replica=replica_id(f.replica, None if worker is None else worker.index),
        version=_version(),
        wait=f.wait,
        report_interval=f.report_interval,
        report_ttl=f.report_ttl,
        start_timeout=f.start_timeout,
        compact_every=f.compact_every,
        log_timeout=f.log_timeout,
    )


def describe_replica(svc: Services) -> Description:
    """What this replica tells the fleet's registry of itself: where it listens, its in-flight
    count and view of health per backend, and its figures since it started, read from the
    metrics and the limiter's counts as they stand (once per report, nothing per request)."""
    s, metrics, backends = svc.settings, svc.metrics, svc.pool.all()
    families = [
        *metrics.requests.collect(),
        *metrics.ttft.collect(),
        *metrics.pool_requests.collect(),
        *metrics.pool_errors.collect(),  # the pools' figures a rollout's gates judge
        *metrics.pool_ttft.collect(),
        *metrics.pool_itl.collect(),
    ]
    manager = svc.manager
    return Description(
        address=f"{s.host}:{s.port}",
        in_flight={b.id: b.in_flight for b in backends},
        health={b.id: b.health.state.value for b in backends},
        figures=read_figures(families, svc.limiter.rejections),
        driving=dict(svc.driver.progress),
        held=dict(svc.holds.held) if svc.holds is not None else {},
        capacity=manager.look if manager is not None and manager.token else {},
    )


async def replica_figures(svc: Services) -> dict[str, Figures]:
    """Each replica's figures, as the registry has them (a rollout's gates read them)."""
    if svc.fleet is None:
        return {"self": describe_replica(svc).figures}
    return {r.id: r.figures for r in await svc.fleet.registry.replicas()}


def _version() -> str:
    try:
        return metadata.version("llm-gateway")
    except metadata.PackageNotFoundError:
        return "unknown"
