"""Small real servers on loopback for tests: the gateway itself, a server that never answers.

The one fake vLLM (``FakeBackend`` and its behaviours) lives in ``tools.fake_vllm``, the
one way to wait in ``tests.waiting``; both are re-exported here for the tests' convenience.
``gateway_for`` is the set-up most tests share: fakes served, the gateway in front of them,
and a client session to it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import aiohttp
from aiohttp import web

from gateway.admin.api import create_admin_app
from gateway.config.settings import Settings
from gateway.http import Server
from gateway.request.endpoints import ENDPOINTS
from gateway.request.services import Services
from gateway.root import open_gateway
from gateway.server import data_plane, make_runner, ssl_context
from tests.waiting import wait_for
from tools.fake_vllm import (
    Behaviour,
    FakeBackend,
    Seen,
    answer,
    bound_socket,
    chat_chunk,
    echo_json,
    hang_before_headers,
    kill,
    running_fake,
    sse,
    stream_chat,
)
from tools.sim.testing import RunningSim

__all__ = [
    "Behaviour",
    "FakeBackend",
    "Rig",
    "RunningGateway",
    "Seen",
    "answer",
    "bound_socket",
    "chat_chunk",
    "echo_json",
    "fronting",
    "gateway_for",
    "hang_before_headers",
    "hung_server",
    "kill",
    "running_fake",
    "running_gateway",
    "serve_app",
    "sse",
    "stopped",
    "stream_chat",
    "wait_for",
]


@asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[str]:
    """Run ``app`` on a free port, as the gateway's own server runs it; yield its base URL."""
    runner = make_runner(app, shutdown_timeout=0.5)
    await runner.setup()
    sock = bound_socket()
    site = web.SockSite(runner, sock)
    await site.start()
    port = sock.getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def hung_server() -> AsyncIterator[str]:
    """A server that accepts connections and never answers (a hung or loading engine)."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    sock = bound_socket()
    server = await asyncio.start_server(hold, sock=sock)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        for w in held:
            w.transport.abort()
        server.close()
        await server.wait_closed()


@asynccontextmanager
async def stopped(fake: FakeBackend) -> AsyncIterator[None]:
    """Stop ``fake``'s server (its port then refuses connections) for the rest of a block."""
    assert fake.runner is not None
    await fake.runner.cleanup()
    yield


@dataclass
class RunningGateway:
    url: str
    svc: Services  # the gateway's services (``gateway.root.open_gateway``)
    server: Server
    admin_url: str | None = None

    def in_flight(self) -> dict[str, int]:
        return {b.id: b.in_flight for b in self.svc.pool.all()}

    def ready(self) -> bool:
        return self.svc.pool.ready()


@asynccontextmanager
async def running_gateway(
    backend_urls: list[str] | list[dict[str, Any]], **overrides: Any
) -> AsyncIterator[RunningGateway]:
    scrape = {"interval": 0.05, "timeout": 0.5, "stale_after": 1.0, "models_interval": 0.2}
    scrape.update(overrides.pop("scrape", {}))
    health = {"interval": 0.05, "timeout": 0.5}
    health.update(overrides.pop("health", {}))
    resolver = overrides.pop("resolver", None)
    tracer_provider = overrides.pop("tracer_provider", None)
    loader = overrides.pop("loader", None)
    transport = overrides.pop("transport", None)
    wait_models = overrides.pop("wait_models", True)
    endpoints = overrides.pop("endpoints", ENDPOINTS)  # the table the data plane routes
    overrides.setdefault("shutdown_grace", 0.5)
    overrides.setdefault("log_level", "warning")
    settings = Settings(backends=backend_urls, scrape=scrape, health=health, **overrides)
    async with open_gateway(
        settings,
        resolver=resolver,
        tracer_provider=tracer_provider,
        loader=loader,
        transport=transport,
    ) as svc:
        server = data_plane(svc, endpoints)
        sock = bound_socket()
        await server.start(sock=sock, ssl=ssl_context(settings.tls))
        scheme = "https" if settings.tls.enabled else "http"
        url = f"{scheme}://127.0.0.1:{sock.getsockname()[1]}"
        gw = RunningGateway(url=url, svc=svc, server=server)
        admin_runner = None
        if settings.admin.token is not None:
            admin_runner = make_runner(
                create_admin_app(svc, settings.admin.token.get_secret_value()),
                shutdown_timeout=0.5,
            )
            await admin_runner.setup()
            admin_sock = bound_socket()
            await web.SockSite(admin_runner, admin_sock).start()
            gw.admin_url = f"http://127.0.0.1:{admin_sock.getsockname()[1]}"
        try:
            # The start-up's first look at the backends is bounded (2 s, each probe by its
            # timeout): on a busy machine it can end before a backend that is up has listed its
            # models, and a request for them is then a 404 (models unknown). Tests assume the
            # gateway has met its backends: wait for that, the event, not a time. A test whose
            # backend never lists its models says so (``wait_models=False``).
            if wait_models:
                await wait_for(
                    lambda: all(b.models_known for b in svc.pool.all()),
                    within=30.0,
                    what="every backend's models listed to the gateway",
                )
            yield gw
        finally:
            if admin_runner is not None:
                await admin_runner.cleanup()
            await server.cleanup(settings.shutdown_grace)


class Rig(NamedTuple):
    """A running gateway and a client session to it (unpacked: ``as (gw, s)``)."""

    gw: RunningGateway
    session: aiohttp.ClientSession


@asynccontextmanager
async def fronting(
    *fakes: FakeBackend | RunningSim, names: Sequence[str] | None = None, **settings: Any
) -> AsyncIterator[RunningGateway]:
    """Serve ``fakes`` (fake vLLMs, or simulators not yet started) and run the gateway in
    front of them, in that order (named ``names`` if given, else by address), with
    ``settings`` as ``running_gateway`` takes them."""
    async with AsyncExitStack() as stack:
        for fake in fakes:
            if isinstance(fake, FakeBackend):
                await stack.enter_async_context(running_fake(fake))
            else:
                await fake.start()
                stack.push_async_callback(fake.stop)
        backends: list[str] | list[dict[str, Any]] = [f.url for f in fakes]
        if names is not None:
            backends = [{"url": f.url, "name": n} for f, n in zip(fakes, names, strict=True)]
        yield await stack.enter_async_context(running_gateway(backends, **settings))


@asynccontextmanager
async def gateway_for(
    *fakes: FakeBackend | RunningSim, names: Sequence[str] | None = None, **settings: Any
) -> AsyncIterator[Rig]:
    """``fronting`` and a client session to the gateway, closed first on exit."""
    async with (
        fronting(*fakes, names=names, **settings) as gw,
        aiohttp.ClientSession() as session,
    ):
        yield Rig(gw, session)


def sample(gw: RunningGateway, name: str, **labels: str) -> float:
    """A metric's value in the gateway's registry (0 if the series does not exist)."""
    return gw.svc.metrics.registry.get_sample_value(name, labels) or 0.0


def events(raw: bytes) -> list[Any]:
    """A stream's events: each ``data`` as JSON, or the string ``[DONE]``."""
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
