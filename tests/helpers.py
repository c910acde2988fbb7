"""Small real servers on loopback for tests: a scriptable fake vLLM and the gateway itself."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from gateway.admin import create_admin_app
from gateway.app import create_app
from gateway.keys import POOL
from gateway.server import make_runner, ssl_context
from gateway.settings import Settings


def bound_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket on a free loopback port, kept open so no other process takes it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


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


async def wait_for(
    predicate: Callable[[], bool], *, within: float = 5.0, what: str = "condition"
) -> float:
    """Poll ``predicate`` until true; return when (monotonic). Fail after ``within`` s."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.002)  # sleep-ok: polling interval of a deadline-bounded wait
    return time.monotonic()


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chat_chunk(
    content: str | None = None, *, role: bool = False, finish: str | None = None
) -> bytes:
    delta: dict[str, Any] = {}
    if role:
        delta = {"role": "assistant", "content": ""}
    elif content is not None:
        delta = {"content": content}
    return sse(
        {
            "id": "chatcmpl-x",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
    )


@dataclass
class Seen:
    """One request as the fake backend received it, and how its handler ended."""

    path: str
    headers: CIMultiDict[str]
    body: bytes
    started_at: float
    ended_at: float | None = None
    ending: str | None = None  # "complete", "cancelled", "write_failed"
    transport: asyncio.BaseTransport | None = None


Behaviour = Callable[[web.Request, "FakeBackend", Seen], Awaitable[web.StreamResponse]]


@dataclass
class FakeBackend:
    """An aiohttp imitation of vLLM whose answers a test scripts.

    ``behaviour`` handles the completion endpoints; ``release`` lets a test hold a stream at a
    point of its choosing; ``seen`` records every request and when its handler ended (a
    cancelled handler means the gateway closed the upstream connection).
    """

    models: list[str] = field(default_factory=lambda: ["m"])
    behaviour: Behaviour | None = None
    metrics_text: str = (
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0\n'
    )
    models_status: int = 200
    health_status: int = 200
    health_hangs: bool = False
    probes: list[tuple[float, int]] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""
    runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        return app

    def active(self) -> int:
        return sum(1 for s in self.seen if s.ended_at is None)

    async def _models(self, request: web.Request) -> web.Response:
        if self.models_status != 200:
            return web.json_response({"error": "nope"}, status=self.models_status)
        return web.json_response(
            {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def _health(self, request: web.Request) -> web.Response:
        if self.health_hangs:
            await self.release.wait()
        self.probes.append((time.monotonic(), self.health_status))
        return web.Response(status=self.health_status)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        seen = Seen(
            path=request.path,
            headers=CIMultiDict(request.headers),
            body=await request.read(),
            started_at=time.monotonic(),
            transport=request.transport,
        )
        self.seen.append(seen)
        try:
            behaviour = self.behaviour or echo_json
            resp = await behaviour(request, self, seen)
            seen.ending = "complete"
            return resp
        except asyncio.CancelledError:
            seen.ending = "cancelled"
            raise
        except ConnectionResetError:
            seen.ending = "write_failed"
            raise
        finally:
            seen.ended_at = time.monotonic()


async def echo_json(request: web.Request, fake: FakeBackend, seen: Seen) -> web.StreamResponse:
    doc = json.loads(seen.body)
    return web.json_response(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": doc.get("model"),
            "choices": [{"index": 0, "text": "hello", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            "echo_headers": dict(request.headers),
        }
    )


def stream_chat(
    n_tokens: int = 5, *, hold_after: int | None = None, delay: float = 0.0
) -> Behaviour:
    """Stream ``n_tokens`` chat chunks; optionally wait for ``fake.release`` after some."""

    async def behaviour(request: web.Request, fake: FakeBackend, seen: Seen) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chat_chunk(role=True))
        for i in range(n_tokens):
            if hold_after is not None and i == hold_after:
                await fake.release.wait()
            if delay:
                await asyncio.sleep(delay)
            await resp.write(chat_chunk(f"t{i} "))
        await resp.write(chat_chunk(finish="stop"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return behaviour


async def hang_before_headers(
    request: web.Request, fake: FakeBackend, seen: Seen
) -> web.StreamResponse:
    await fake.release.wait()
    return web.json_response({"late": True})


@asynccontextmanager
async def running_fake(
    fake: FakeBackend, *, sock: socket.socket | None = None
) -> AsyncIterator[FakeBackend]:
    runner = web.AppRunner(
        fake.app(), handler_cancellation=True, access_log=None, shutdown_timeout=0.2
    )
    await runner.setup()
    sock = sock or bound_socket()
    await web.SockSite(runner, sock).start()
    host, port = sock.getsockname()[:2]
    fake.url = f"http://{host}:{port}"
    fake.runner = runner
    try:
        yield fake
    finally:
        await runner.cleanup()


async def kill(fake: FakeBackend) -> None:
    """Crash ``fake``: reset every open request's connection and stop listening."""
    for seen in fake.seen:
        if seen.ended_at is None and seen.transport is not None:
            seen.transport.abort()
    assert fake.runner is not None
    await fake.runner.cleanup()


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
    app: web.Application
    runner: web.AppRunner
    admin_url: str | None = None

    def in_flight(self) -> dict[str, int]:
        return {b.id: b.in_flight for b in self.app[POOL].all()}

    def ready(self) -> bool:
        return self.app[POOL].ready()


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
    overrides.setdefault("shutdown_grace", 0.5)
    overrides.setdefault("log_level", "warning")
    settings = Settings(backends=backend_urls, scrape=scrape, health=health, **overrides)
    app = create_app(
        settings,
        resolver=resolver,
        tracer_provider=tracer_provider,
        loader=loader,
        transport=transport,
    )
    runner = make_runner(app, shutdown_timeout=settings.shutdown_grace)
    await runner.setup()
    sock = bound_socket()
    await web.SockSite(runner, sock, ssl_context=ssl_context(settings.tls)).start()
    scheme = "https" if settings.tls.enabled else "http"
    gw = RunningGateway(url=f"{scheme}://127.0.0.1:{sock.getsockname()[1]}", app=app, runner=runner)
    admin_runner = None
    if settings.admin.token is not None:
        admin_runner = make_runner(
            create_admin_app(app, settings.admin.token.get_secret_value()), shutdown_timeout=0.5
        )
        await admin_runner.setup()
        admin_sock = bound_socket()
        await web.SockSite(admin_runner, admin_sock).start()
        gw.admin_url = f"http://127.0.0.1:{admin_sock.getsockname()[1]}"
    try:
        yield gw
    finally:
        if admin_runner is not None:
            await admin_runner.cleanup()
        await runner.cleanup()
