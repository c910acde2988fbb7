"""Fake vLLM OpenAI-compatible server for the peer bench.

Imitates just enough of ``vllm serve``:
  POST /v1/completions, /v1/chat/completions  (stream true/false)
  GET  /health (200), /v1/models, /metrics (Prometheus), /version, /ping

Streaming output follows vLLM's SSE format: one ``data: {json}\\n\\n`` event per token, the last
token chunk carries finish_reason "length", an optional usage chunk (choices == []) when
stream_options.include_usage is true, then ``data: [DONE]\\n\\n``. For chat, a first chunk with
delta {"role": "assistant", "content": ""} precedes the token chunks (as vLLM does).

Timing: the first token is sent --ttft-ms after the request arrives; token i is sent at
ttft + i*itl (absolute schedule, no drift). --itl-ms 0 means "as fast as possible", but the
handler still yields to the event loop between tokens so that concurrent streams interleave
like an engine step loop.

This is the bench's own backend, kept byte for byte in its behaviour since the first peer runs
(2026-11-29) so that new figures sit beside the old ones; ``tools.fake_vllm`` is the tests'
scriptable backend and differs in small ways (preformatted events, no per-request ids).
Self-contained (aiohttp and, optionally, uvloop): the driver runs it as a file under any Python
that has them.

Usage: python -m loadtest.peers.fake_backend --port 18001 --ttft-ms 20 --itl-ms 10 --model tiny
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from typing import Any, Final

from aiohttp import web

WORDS: Final = [
    " the", " quick", " brown", " fox", " jumps", " over", " a", " lazy",
    " dog", " and", " then", " runs", " far", " away", " again", ".",
]  # fmt: skip
WORDS_JSON: Final = [json.dumps(w)[1:-1] for w in WORDS]  # escaped, no quotes


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model: str = args.model
        self.running = 0
        self.waiting = 0
        self.success = 0
        self.aborted = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.sem = asyncio.Semaphore(args.max_num_seqs) if args.max_num_seqs > 0 else None


STATE: Final = web.AppKey("state", State)


def _prompt_len(body: dict[str, Any], chat: bool) -> int:
    try:
        if chat:
            n = 0
            for m in body.get("messages") or []:
                c = m.get("content")
                if isinstance(c, str):
                    n += len(c.split()) + 4
                elif isinstance(c, list):
                    for part in c:
                        if isinstance(part, dict) and isinstance(part.get("text"), str):
                            n += len(part["text"].split())
            return max(n, 1)
        p = body.get("prompt", "")
        if isinstance(p, list):
            if p and isinstance(p[0], int):
                return len(p)
            return max(sum(len(str(x).split()) for x in p), 1)
        return max(len(str(p).split()), 1)
    except Exception:
        return 1


async def _sleep_until(t: float) -> None:
    d = t - time.perf_counter()
    if d > 0:
        await asyncio.sleep(d)
    else:
        await asyncio.sleep(0)


def _error(status: int, msg: str, typ: str = "BadRequestError") -> web.Response:
    return web.json_response(
        {"object": "error", "message": msg, "type": typ, "param": None, "code": status},
        status=status,
    )


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    st = request.app[STATE]
    try:
        body = await request.json()
    except Exception:
        return _error(400, "invalid JSON body")
    if not isinstance(body, dict):
        return _error(400, "body must be an object")
    model = body.get("model") or st.model
    n_tok_asked: Any = body.get("max_tokens", body.get("max_completion_tokens", 16))
    try:
        n_tok = max(1, int(n_tok_asked))
    except Exception:
        return _error(400, "max_tokens must be an integer")
    stream = bool(body.get("stream", False))
    so = body.get("stream_options") or {}
    include_usage = bool(so.get("include_usage", False)) if isinstance(so, dict) else False
    p_len = _prompt_len(body, chat)
    ttft = st.args.ttft_ms / 1000.0
    itl = st.args.itl_ms / 1000.0

    t0 = time.perf_counter()
    if st.sem is not None:
        st.waiting += 1
        try:
            await st.sem.acquire()
        finally:
            st.waiting -= 1
    st.running += 1
    try:
        if stream:
            return await _stream(
                request,
                st,
                chat=chat,
                model=model,
                n_tok=n_tok,
                include_usage=include_usage,
                p_len=p_len,
                t0=t0,
                ttft=ttft,
                itl=itl,
            )
        await _sleep_until(t0 + ttft + (n_tok - 1) * itl)
        return _full_response(chat, model, n_tok, p_len, st)
    finally:
        st.running -= 1
        if st.sem is not None:
            st.sem.release()


def _full_response(chat: bool, model: Any, n_tok: int, p_len: int, st: State) -> web.Response:
    text = "".join(WORDS[i % len(WORDS)] for i in range(n_tok))
    created = int(time.time())
    usage = {"prompt_tokens": p_len, "total_tokens": p_len + n_tok, "completion_tokens": n_tok}
    st.success += 1
    st.prompt_tokens += p_len
    st.generation_tokens += n_tok
    if chat:
        return web.json_response(
            {
                "id": "chatcmpl-" + uuid.uuid4().hex,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text, "tool_calls": []},
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                    }
                ],
                "usage": usage,
            }
        )
    return web.json_response(
        {
            "id": "cmpl-" + uuid.uuid4().hex,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
            ],
            "usage": usage,
        }
    )


async def _stream(
    request: web.Request,
    st: State,
    *,
    chat: bool,
    model: Any,
    n_tok: int,
    include_usage: bool,
    p_len: int,
    t0: float,
    ttft: float,
    itl: float,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200,
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"},
    )
    await resp.prepare(request)
    created = int(time.time())
    mjson = json.dumps(model)
    first: str | None
    if chat:
        rid = "chatcmpl-" + uuid.uuid4().hex
        head = (
            f'{{"id":"{rid}","object":"chat.completion.chunk","created":{created},'
            f'"model":{mjson},"choices":[{{"index":0,'
        )
        tok_fmt = head + '"delta":{"content":"%s"},"logprobs":null,"finish_reason":null}]}'
        last_fmt = (
            head + '"delta":{"content":"%s"},"logprobs":null,"finish_reason":"length",'
            '"stop_reason":null}]}'
        )
        first = (
            head + '"delta":{"role":"assistant","content":""},"logprobs":null,'
            '"finish_reason":null}]}'
        )
        usage_obj = "chat.completion.chunk"
    else:
        rid = "cmpl-" + uuid.uuid4().hex
        head = (
            f'{{"id":"{rid}","object":"text_completion","created":{created},"model":{mjson},'
            f'"choices":[{{"index":0,'
        )
        tok_fmt = head + '"text":"%s","logprobs":null,"finish_reason":null,"stop_reason":null}]}'
        last_fmt = (
            head + '"text":"%s","logprobs":null,"finish_reason":"length","stop_reason":null}]}'
        )
        first = None
        usage_obj = "text_completion"
    sent = 0
    try:
        await _sleep_until(t0 + ttft)
        if first is not None:
            await resp.write(b"data: " + first.encode() + b"\n\n")
        nw = len(WORDS_JSON)
        for i in range(n_tok):
            if i:
                if itl > 0:
                    await _sleep_until(t0 + ttft + i * itl)
                else:
                    await asyncio.sleep(0)
            fmt = last_fmt if i == n_tok - 1 else tok_fmt
            await resp.write(b"data: " + (fmt % WORDS_JSON[i % nw]).encode() + b"\n\n")
            sent += 1
        if include_usage:
            u = (
                f'{{"id":"{rid}","object":"{usage_obj}","created":{created},"model":{mjson},'
                f'"choices":[],"usage":{{"prompt_tokens":{p_len},'
                f'"total_tokens":{p_len + n_tok},"completion_tokens":{n_tok}}}}}'
            )
            await resp.write(b"data: " + u.encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        st.success += 1
    except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
        st.aborted += 1
        raise
    finally:
        st.prompt_tokens += p_len
        st.generation_tokens += sent
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": st.model,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "vllm",
                    "root": st.model,
                    "parent": None,
                    "max_model_len": st.args.max_model_len,
                    "permission": [],
                }
            ],
        }
    )


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": "0.0.0-fake"})


async def metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    lbl = f'engine="0",model_name={json.dumps(st.model)}'
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{lbl}}} {st.running:.1f}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{lbl}}} {st.waiting:.1f}",
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
        f'vllm:request_success_total{{{lbl},finished_reason="length"}} {st.success:.1f}',
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{lbl}}} {st.prompt_tokens:.1f}",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{lbl}}} {st.generation_tokens:.1f}",
        "",
    ]
    return web.Response(
        text="\n".join(lines),
        content_type="text/plain",
        charset="utf-8",
        headers={"X-Fake-Aborted": str(st.aborted)},
    )


@web.middleware
async def log_unknown(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        resp: web.StreamResponse = await handler(request)
    except web.HTTPNotFound:
        if request.app[STATE].args.log_unknown:
            print(f"fake_backend: 404 {request.method} {request.path}", file=sys.stderr, flush=True)
        raise
    return resp


def make_app(args: argparse.Namespace) -> web.Application:
    app = web.Application(middlewares=[log_unknown], client_max_size=64 * 1024 * 1024)

    async def on_startup(app: web.Application) -> None:
        # made on the running loop: the semaphore binds to it
        app[STATE] = State(args)

    app.on_startup.append(on_startup)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--ttft-ms", type=float, default=0.0, help="delay before first token")
    ap.add_argument(
        "--itl-ms", type=float, default=0.0, help="gap between tokens (0 = as fast as possible)"
    )
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=0,
        help="if >0, at most this many requests run at once; the rest count as waiting",
    )
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--log-unknown", action="store_true", help="log requests to unknown paths")
    ap.add_argument("--no-uvloop", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.no_uvloop:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
    web.run_app(
        make_app(args),
        host=args.host,
        port=args.port,
        backlog=4096,
        access_log=None,
        print=None,
        handle_signals=True,
    )


if __name__ == "__main__":
    main()
