"""The tests' scripted behaviours for ``FakeBackend``: stream a few chunks (and hold the stream
until ``fake.release``), answer with an error, hang before the head; and the SSE chunks they
are made of, for tests that write their own behaviours."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from tools.fake_vllm.backend import Behaviour, FakeBackend, Seen


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
