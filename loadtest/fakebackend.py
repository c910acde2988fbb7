"""A minimal vLLM look-alike for the overhead benchmark: paced token streams, no engine model.

``python -m loadtest.fakebackend --port 0 --ttft-ms 20 --itl-ms 10`` serves
``POST /v1/chat/completions`` and ``/v1/completions`` (stream or not): the first token
``ttft`` after the request arrives, token *i* at ``ttft + i x itl`` on an absolute schedule,
``max_tokens`` tokens of one word each, vLLM's chunk format, the usage chunk when asked for,
then ``[DONE]``. ``--itl-ms 0`` sends as fast as it can, still yielding to the loop between
tokens, so events reach the gateway in bursts. It also answers ``/health``, ``/v1/models``
and ``/metrics`` (running and waiting gauges) so the gateway routes to it as to vLLM. It is
deliberately cheap: the benchmark runs it on the same core as the load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from typing import Any

from aiohttp import web

_WORDS = (" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", ".")


class _Fake:
    def __init__(self, model: str, ttft: float, itl: float) -> None:
        self.model = model
        self.ttft = ttft
        self.itl = itl
        self.running = 0
        # Every event is preformatted bytes: no JSON encoding per token.
        self.chat = [
            _event(model, "chat.completion.chunk", {"delta": {"content": w}}) for w in _WORDS
        ]
        self.text = [_event(model, "text_completion", {"text": w}) for w in _WORDS]
        self.role = _event(
            model, "chat.completion.chunk", {"delta": {"role": "assistant", "content": ""}}
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        chat = request.path.endswith("/chat/completions")
        body: Any = await request.json()
        n = max(1, int(body.get("max_tokens") or 16))
        self.running += 1
        try:
            if not body.get("stream"):
                await _until(t0 + self.ttft + (n - 1) * self.itl)
                return web.json_response(self._full(chat, n))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
            await resp.prepare(request)
            events = self.chat if chat else self.text
            if chat:
                await _until(t0 + self.ttft)
                await resp.write(b"data: " + self.role + b"\n\n")
            for i in range(n):
                await _until(t0 + self.ttft + i * self.itl)
                await resp.write(b"data: " + events[i % len(events)] + b"\n\n")
            usage = body.get("stream_options") or {}
            if isinstance(usage, dict) and usage.get("include_usage"):
                u = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": n + 8}
                tail = {"id": "f", "object": "chat.completion.chunk", "choices": [], "usage": u}
                await resp.write(b"data: " + json.dumps(tail).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.running -= 1

    def _full(self, chat: bool, n: int) -> dict[str, Any]:
        text = "".join(_WORDS[i % len(_WORDS)] for i in range(n))
        usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": n + 8}
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": "f", "model": self.model, "choices": [choice], "usage": usage}

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "fake"}
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        labels = f'{{engine="0",model_name="{self.model}"}}'
        text = (
            f"vllm:num_requests_running{labels} {self.running}\n"
            f"vllm:num_requests_waiting{labels} 0\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()


def _event(model: str, obj: str, choice: dict[str, Any]) -> bytes:
    c = {"index": 0, **choice, "logprobs": None, "finish_reason": None}
    doc = {"id": "fake", "object": obj, "created": 0, "model": model, "choices": [c]}
    return json.dumps(doc, separators=(",", ":")).encode()


async def _until(t: float) -> None:
    delay = t - time.perf_counter()
    await asyncio.sleep(delay if delay > 0 else 0)  # sleep-ok: the paced token schedule


def create_app(model: str = "tiny", ttft_ms: float = 20.0, itl_ms: float = 10.0) -> web.Application:
    fake = _Fake(model, ttft_ms / 1e3, itl_ms / 1e3)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.generate)
    app.router.add_post("/v1/completions", fake.generate)
    app.router.add_get("/v1/models", fake.models)
    app.router.add_get("/metrics", fake.metrics)
    app.router.add_get("/health", fake.health)
    return app


async def _serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(create_app(args.model, args.ttft_ms, args.itl_ms), access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    site = web.SockSite(runner, sock, backlog=4096)
    await site.start()
    port = sock.getsockname()[1]
    print(f"fake backend: serving {args.model!r} on http://127.0.0.1:{port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
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
