"""The production configuration in tests: every feature on at once, in front of simulators.

Keys in tiers, Redis-shared limits, the admission queue, prefix affinity with hash placement,
a model pool with a weighted canary alias, tracing, and the admin API: the combination an
operator runs (``deploy/gateway.production.toml``), on small numbers a test can reach.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.limits.keys import hash_key
from tests.helpers import RunningGateway, running_gateway
from tools.sim import FAST, running_sim
from tools.sim.config import SimConfig
from tools.sim.testing import RunningSim

ADMIN_TOKEN = "admin-secret-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
KEYS = {"alice": "sk-alice-prod", "bob": "sk-bob-prod", "carol": "sk-carol-prod"}
ALIAS = "chat"  # the public name: 90 % stable pool, 10 % canary


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def production_overrides(
    sim_urls: list[str], redis_url: str, redis_prefix: str, **changes: Any
) -> dict[str, Any]:
    """Settings with every feature on; ``changes`` replaces top-level sections."""
    backends = [{"url": u, "name": f"sim{i}"} for i, u in enumerate(sim_urls)]
    settings: dict[str, Any] = {
        "policy": "prefix_affinity",
        "affinity": {"placement": "hash", "balance_abs": 4, "session_header": "x-session-id"},
        "pools": [
            {"name": "stable", "model": "sim-model", "backends": ["sim0", "sim1"]},
            {"name": "canary", "model": "sim-model", "backends": ["sim2"]},
        ],
        "aliases": {ALIAS: {"stable": 9, "canary": 1}},
        "rollout": {"sticky_header": "x-session-id"},
        "limits": {
            "auth": True,
            "store": "redis",
            "redis": {"url": redis_url, "key_prefix": redis_prefix, "timeout": 0.5},
            "tiers": {
                "default": {"requests_per_minute": 6000, "max_concurrent": 16},
                "interactive": {
                    "requests_per_minute": 6000,
                    "tokens_per_minute": 2_000_000,
                    "max_concurrent": 32,
                    "max_priority": 5,
                },
                "batch": {"requests_per_minute": 3000, "max_concurrent": 8},
            },
            "keys": [
                {"name": "alice", "hash": hash_key(KEYS["alice"]), "tier": "interactive"},
                {"name": "bob", "hash": hash_key(KEYS["bob"]), "tier": "batch"},
                {"name": "carol", "hash": hash_key(KEYS["carol"])},
            ],
            "admission": {
                "enabled": True,
                "max_size": 64,
                "max_wait": 5.0,
                "max_in_flight": 4,
                "max_queue_depth": 4,
                "max_kv_usage": 0.95,
            },
        },
        "admin": {"token": ADMIN_TOKEN},
        "retry": {"max_attempts": 3, "deadline": 10.0},
    }
    settings["backends"] = backends
    settings.update(changes)
    return settings


@dataclass
class Production:
    gateway: RunningGateway
    sims: list[RunningSim]
    spans: InMemorySpanExporter

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def admin_url(self) -> str:
        assert self.gateway.admin_url is not None
        return self.gateway.admin_url


@asynccontextmanager
async def running_production(
    redis_url: str,
    redis_prefix: str,
    *,
    sims: int = 3,
    sim_config: SimConfig = FAST,
    **changes: Any,
) -> AsyncIterator[Production]:
    """Three simulators and one gateway with every feature on (see module docstring)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with AsyncExitStack() as stack:
        running = [await stack.enter_async_context(running_sim(sim_config)) for _ in range(sims)]
        overrides = production_overrides(
            [s.url for s in running], redis_url, redis_prefix, **changes
        )
        backends = overrides.pop("backends")
        gw = await stack.enter_async_context(
            running_gateway(backends, tracer_provider=provider, **overrides)
        )
        yield Production(gw, running, exporter)
