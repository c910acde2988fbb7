"""The one fake vLLM: a small aiohttp imitation whose answers are scripted.

Tests give it a ``behaviour`` for the completion endpoints (answer at once, stream, hold a
stream until released, hang before the head, lie in the framing...) and read what it saw
(``seen``: every request and how its handler ended; a cancelled handler means the gateway
closed the upstream connection, as vLLM needs in order to abort). The overhead benchmark runs
it as a process with the ``paced`` behaviour:

``python -m tools.fake_vllm --port 0 --ttft-ms 20 --itl-ms 10`` serves
``POST /v1/chat/completions`` and ``/v1/completions`` (stream or not): the first token
``ttft`` after the request arrives, token *i* at ``ttft + i x itl`` on an absolute schedule,
``max_tokens`` tokens of one word each, vLLM's chunk format, the usage chunk when asked for,
then ``[DONE]``. ``--itl-ms 0`` sends as fast as it can, still yielding to the loop between
tokens, so events reach the gateway in bursts. Unrecorded (``record=False``) and with every
event preformatted, it is cheap: the benchmark runs it on the same core as the load generator.

``loadtest.counting`` adds the ``counting`` behaviour: a deterministic "model" whose answers
go on from where a prompt left off, for the tests of stream continuation.

Both answer ``/health``, ``/v1/models`` and ``/metrics`` (running and waiting gauges), so the
gateway routes to them as to vLLM. The simulator (``tools.sim``) is the other backend the
tests run: an engine model, for what depends on scheduling and caches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

_WORDS = (" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", ".")


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
    transport: asyncio.Transport | None = None


Behaviour = Callable[[web.Request, "FakeBackend", Seen], Awaitable[web.StreamResponse]]


@dataclass
class FakeBackend:
    """A scriptable imitation of vLLM (see the module docstring).

    ``behaviour`` answers the completion endpoints (``echo_json`` by default); ``release``
    lets a test hold a stream at a point of its choosing; ``metrics_text`` replaces the
    ``/metrics`` answer (by default: the requests running now, none waiting).
    """

    models: list[str] = field(default_factory=lambda: ["m"])
    behaviour: Behaviour | None = None
    metrics_text: str | None = None
    models_status: int = 200
    health_status: int = 200
    health_hangs: bool = False
    record: bool = True  # False: keep no ``seen`` list or probe log (the benchmark's)
    probes: list[tuple[float, int]] = field(default_factory=list)
    scrapes: int = 0  # GET /metrics answered
    seen: list[Seen] = field(default_factory=list)
    tokenized: list[dict[str, Any]] = field(default_factory=list)  # /tokenize bodies
    release: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""
    runner: web.AppRunner | None = None
    running: int = 0  # requests whose handler has not ended
    counter: int = 0  # answers begun (ids for ``counting``)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
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
        cards = [
            {"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.models
        ]
        return web.json_response({"object": "list", "data": cards})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        text = self.metrics_text
        if text is None:
            text = "".join(
                f'vllm:num_requests_running{{engine="0",model_name="{m}"}} {self.running}\n'
                f'vllm:num_requests_waiting{{engine="0",model_name="{m}"}} 0\n'
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="{m}"}} 0.0\n'
                for m in self.models
            )
        return web.Response(text=text, content_type="text/plain")

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


# -- behaviours ------------------------------------------------------------------------------


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
    n_tokens: int = 5,
    *,
    hold_after: int | None = None,
    delay: float = 0.0,
    first_after: float = 0.0,
    word: str = "t",
) -> Behaviour:
    """Stream ``n_tokens`` chat chunks (``{word}0 ``, ``{word}1 ``...); optionally wait for
    ``fake.release`` after some. The head is sent at once, the first chunk ``first_after`` s
    later (an engine's time to first token)."""

    async def behaviour(request: web.Request, fake: FakeBackend, seen: Seen) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if first_after:
            await asyncio.sleep(first_after)  # sleep-ok: the scripted time to the first token
        await resp.write(chat_chunk(role=True))
        for i in range(n_tokens):
            if hold_after is not None and i == hold_after:
                await fake.release.wait()
            if delay:
                await asyncio.sleep(delay)  # sleep-ok: the scripted pace of the stream
            await resp.write(chat_chunk(f"{word}{i} "))
        await resp.write(chat_chunk(finish="stop"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return behaviour


def answer(status: int, message: str, **headers: str) -> Behaviour:
    """Answer every request with ``status`` and an error envelope saying ``message``."""

    async def behaviour(request: web.Request, fake: FakeBackend, seen: Seen) -> web.StreamResponse:
        body = {"error": {"message": message, "type": "error", "param": None, "code": status}}
        return web.json_response(body, status=status, headers=headers)

    return behaviour


async def hang_before_headers(
    request: web.Request, fake: FakeBackend, seen: Seen
) -> web.StreamResponse:
    await fake.release.wait()
    return web.json_response({"late": True})


def _event(model: str, obj: str, choice: dict[str, Any]) -> bytes:
    c = {"index": 0, **choice, "logprobs": None, "finish_reason": None}
    doc = {"id": "fake", "object": obj, "created": 0, "model": model, "choices": [c]}
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


async def _until(t: float) -> None:
    delay = t - time.perf_counter()
    await asyncio.sleep(delay if delay > 0 else 0)  # sleep-ok: the paced token schedule


def paced(model: str, ttft: float, itl: float) -> Behaviour:
    """vLLM's answers on a schedule: first token after ``ttft`` s, then one per ``itl`` s."""
    chat_events = [
        _event(model, "chat.completion.chunk", {"delta": {"content": w}}) for w in _WORDS
    ]
    text_events = [_event(model, "text_completion", {"text": w}) for w in _WORDS]
    role = _event(model, "chat.completion.chunk", {"delta": {"role": "assistant", "content": ""}})

    def whole(chat: bool, n: int) -> dict[str, Any]:
        text = "".join(_WORDS[i % len(_WORDS)] for i in range(n))
        usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": n + 8}
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": "f", "model": model, "choices": [choice], "usage": usage}

    async def behaviour(request: web.Request, fake: FakeBackend, seen: Seen) -> web.StreamResponse:
        t0 = time.perf_counter()
        chat = request.path.endswith("/chat/completions")
        body: Any = json.loads(seen.body)
        n = max(1, int(body.get("max_tokens") or 16))
        if not body.get("stream"):
            await _until(t0 + ttft + (n - 1) * itl)
            return web.json_response(whole(chat, n))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        events = chat_events if chat else text_events
        if chat:
            await _until(t0 + ttft)
            await resp.write(role)
        for i in range(n):
            await _until(t0 + ttft + i * itl)
            await resp.write(events[i % len(events)])
        usage = body.get("stream_options") or {}
        if isinstance(usage, dict) and usage.get("include_usage"):
            u = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": n + 8}
            tail = {"id": "f", "object": "chat.completion.chunk", "choices": [], "usage": u}
            await resp.write(b"data: " + json.dumps(tail).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return behaviour


def create_app(model: str = "tiny", ttft_ms: float = 20.0, itl_ms: float = 10.0) -> web.Application:
    """The benchmark's paced fake as an app (unrecorded)."""
    fake = FakeBackend(models=[model], behaviour=paced(model, ttft_ms / 1e3, itl_ms / 1e3))
    fake.record = False
    return fake.app()


# -- running it ----------------------------------------------------------------------------


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


async def _serve(args: argparse.Namespace) -> None:
    fake = FakeBackend(
        models=[args.model],
        behaviour=paced(args.model, args.ttft_ms / 1e3, args.itl_ms / 1e3),
        record=False,
    )
    runner = web.AppRunner(fake.app(), access_log=None)
    await runner.setup()
    sock = bound_socket(port=args.port)
    site = web.SockSite(runner, sock, backlog=4096)
    await site.start()
    port = sock.getsockname()[1]
    print(f"fake backend: serving {args.model!r} on http://127.0.0.1:{port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A paced fake vLLM for the overhead benchmark.")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model", default="tiny")
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        asyncio.run(_serve(args))
    else:
        uvloop.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
