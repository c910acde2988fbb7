"""``FakeBackend``: the fake vLLM's server, whose answers to the completion endpoints are left to
a ``behaviour`` (``scripted`` for the tests, ``vllm`` for vLLM's own); ``running_fake`` serves
one on loopback for the length of a block.

Besides the completion endpoints it answers as vLLM does ``/health`` (``/ping``), ``/version``,
``/v1/models``, ``/metrics`` (vLLM's gauges and counters), ``/tokenize`` (a word count) and the
runtime LoRA routes, so that the gateway routes to it as to vLLM. What it saw is kept in
``seen`` (every request, and how its handler ended: a cancelled handler means the gateway
closed the upstream connection, as vLLM needs in order to abort) unless ``record`` is off, as
in the benchmarks.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final

from aiohttp import web
from multidict import CIMultiDict

MAX_MODEL_LEN: Final = 4096  # what /v1/models says; nothing checks a prompt against it
_BODY_LIMIT: Final = 64 * 2**20  # vLLM takes long prompts; aiohttp's default is 1 MiB


@dataclass
class Seen:
    """One request as the fake backend received it, and how its handler ended."""

    path: str
    headers: CIMultiDict[str]
    body: bytes
    started_at: float
    ended_at: float | None = None
    ending: str | None = None  # "complete", "cancelled", "write_failed"
    transport: asyncio.Transport | None = None


Behaviour = Callable[[web.Request, "FakeBackend", Seen], Awaitable[web.StreamResponse]]


@dataclass
class FakeBackend:
    """A scriptable imitation of vLLM (see the module docstring).

    ``behaviour`` answers the completion endpoints (``echo_json`` by default);
    ``release`` lets a test hold a stream at a point of its choosing; ``metrics_text`` replaces
    the ``/metrics`` answer (by default vLLM's: the requests running now, none waiting, and the
    counters a ``vllm`` behaviour keeps); ``log_unknown`` prints requests to unknown paths.
    """

    models: list[str] = field(default_factory=lambda: ["m"])
    behaviour: Behaviour | None = None
    metrics_text: str | None = None
    models_status: int = 200
    health_status: int = 200
    health_hangs: bool = False
    record: bool = True  # False: keep no ``seen`` list or probe log (the benchmarks')
    log_unknown: bool = False
    probes: list[tuple[float, int]] = field(default_factory=list)
    scrapes: int = 0  # GET /metrics answered
    seen: list[Seen] = field(default_factory=list)
    tokenized: list[dict[str, Any]] = field(default_factory=list)  # /tokenize bodies
    release: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""
    runner: web.AppRunner | None = None
    running: int = 0  # requests whose handler has not ended
    counter: int = 0  # answers begun (ids for ``counting``)
    finished: int = 0  # vLLM's counters, kept by the ``vllm`` behaviour
    prompt_tokens: int = 0
    generation_tokens: int = 0

    def app(self) -> web.Application:
        middlewares = [_log_unknown] if self.log_unknown else []
        app = web.Application(middlewares=middlewares, client_max_size=_BODY_LIMIT)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ping", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/load_lora_adapter", self._lora)
        app.router.add_post("/v1/unload_lora_adapter", self._lora)
        return app

    async def _lora(self, request: web.Request) -> web.Response:
        """vLLM's runtime LoRA routes, as far as ``/v1/models`` shows them."""
        name = str((await request.json())["lora_name"])
        if request.path.endswith("/load_lora_adapter"):
            if name not in self.models:
                self.models.append(name)
            return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")
        if name not in self.models:
            return web.json_response({"error": {"message": f"no adapter {name}"}}, status=404)
        self.models.remove(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _tokenize(self, request: web.Request) -> web.Response:
        doc = await request.json()
        if self.record:
            self.tokenized.append(doc)
        return web.json_response({"count": len(str(doc.get("prompt", "")).split())})

    def active(self) -> int:
        return self.running

    async def _models(self, request: web.Request) -> web.Response:
        if self.models_status != 200:
            return web.json_response({"error": "nope"}, status=self.models_status)
        created = int(time.time())
        cards: list[dict[str, Any]] = [
            {
                "id": m,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": m,
                "parent": None,
                "max_model_len": MAX_MODEL_LEN,
                "permission": [],
            }
            for m in self.models
        ]
        return web.json_response({"object": "list", "data": cards})

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.0.0-fake"})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        text = self.metrics_text
        if text is None:
            text = "".join(self._metric_lines(m) for m in self.models)
        return web.Response(text=text, content_type="text/plain")

    def _metric_lines(self, model: str) -> str:
        labels = f'engine="0",model_name="{model}"'
        return (
            f"vllm:num_requests_running{{{labels}}} {self.running:.1f}\n"
            f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} 0.0\n"
            f'vllm:request_success_total{{{labels},finished_reason="length"}} '
            f"{self.finished:.1f}\n"
            f"vllm:prompt_tokens_total{{{labels}}} {self.prompt_tokens:.1f}\n"
            f"vllm:generation_tokens_total{{{labels}}} {self.generation_tokens:.1f}\n"
        )

    async def _health(self, request: web.Request) -> web.Response:
        if self.health_hangs:
            await self.release.wait()
        if self.record:
            self.probes.append((time.monotonic(), self.health_status))
        return web.Response(status=self.health_status)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        seen = Seen(
            path=request.path,
            headers=CIMultiDict(request.headers) if self.record else CIMultiDict(),
            body=await request.read(),
            started_at=time.monotonic(),
            transport=request.transport,
        )
        if self.record:
            self.seen.append(seen)
        self.running += 1
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
            self.running -= 1
            seen.ended_at = time.monotonic()


async def echo_json(request: web.Request, fake: FakeBackend, seen: Seen) -> web.StreamResponse:
    """The default answer: a one-token completion, with the request's headers echoed."""
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


@web.middleware
async def _log_unknown(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        resp: web.StreamResponse = await handler(request)
    except web.HTTPNotFound:
        print(f"fake vLLM: 404 {request.method} {request.path}", file=sys.stderr, flush=True)
        raise
    return resp


def bound_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket on a free loopback port, kept open so no other process takes it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


@asynccontextmanager
async def running_fake(
    fake: FakeBackend, *, sock: socket.socket | None = None
) -> AsyncIterator[FakeBackend]:
    """Serve ``fake`` on loopback (``fake.url``) for the block, as vLLM serves: handlers are
    cancelled when their client goes away."""
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
