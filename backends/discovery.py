"""DNS discovery: every A/AAAA record of a name is a backend, re-resolved on an interval.

This is how ``docker compose --scale`` and a Kubernetes headless Service expose replicas.
A new address is added to the pool (and gets traffic once a probe has seen it up); an address
that has gone stops getting new requests while its in-flight streams finish.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable
from typing import Protocol

import structlog

from backends.state import BackendSpec

log = structlog.get_logger("backends.discovery")


class Resolver(Protocol):
    async def resolve(self, host: str, port: int) -> list[str]:
        """The addresses ``host`` resolves to now (empty if none)."""
        ...


class SystemResolver:
    async def resolve(self, host: str, port: int) -> list[str]:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return sorted({str(info[4][0]) for info in infos})


def backend_for(
    address: str, port: int, *, name: str, scheme: str, api_key: str | None
) -> BackendSpec:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return BackendSpec(
        id=f"{host}:{port}", url=f"{scheme}://{host}:{port}", api_key=api_key, source=name
    )


def diff(current: set[str], wanted: set[str]) -> tuple[set[str], set[str]]:
    """(to add, to remove): pure, for the loop below and its tests."""
    return wanted - current, current - wanted


class DnsDiscovery:
    """Keeps the pool's discovered backends equal to what the names resolve to."""

    def __init__(
        self,
        names: list[str],
        *,
        add: Callable[[BackendSpec], None],
        remove: Callable[[str], None],
        scheme: str = "http",
        api_key: str | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        self._names = [(n.rpartition(":")[0], int(n.rpartition(":")[2]), n) for n in names]
        self._add = add
        self._remove = remove
        self._scheme = scheme
        self._api_key = api_key
        self._resolver: Resolver = resolver or SystemResolver()
        self._known: dict[str, set[str]] = {name: set() for _, _, name in self._names}

    async def refresh(self) -> None:
        for host, port, name in self._names:
            try:
                addresses = await self._resolver.resolve(host, port)
            except OSError as exc:
                # A failed lookup is not an empty answer: keep what we had.
                log.warning("discovery_failed", name=name, error=str(exc))
                continue
            specs = {
                s.id: s
                for s in (
                    backend_for(a, port, name=name, scheme=self._scheme, api_key=self._api_key)
                    for a in addresses
                )
            }
            added, removed = diff(self._known[name], set(specs))
            for backend_id in sorted(added):
                self._add(specs[backend_id])
            for backend_id in sorted(removed):
                self._remove(backend_id)
            if added or removed:
                log.info(
                    "discovery_changed", name=name, added=sorted(added), removed=sorted(removed)
                )
            self._known[name] = set(specs)

    async def run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.refresh()
