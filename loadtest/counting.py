"""The fake vLLM's counting "model": answers that can be continued, and checked for seams.

Its answer is " w0 w1 w2 ...", one token per event, in vLLM's chunk format; a prompt (or a
continued assistant message) ending in " wK" is answered from " wK+1" on. So a stream that
the gateway continues on another backend after the first one failed must read exactly like
one that never broke, word for word. Scripted failures: the connection reset after N tokens,
vLLM's mid-stream error event, a stall until ``fake.release``.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

from tools.fake_vllm import Behaviour, FakeBackend, Seen, sse

_COUNTED = re.compile(r"w(\d+)\s*$")
_FIRST_ID = 1000  # token id of " w0"; " wk" is 1000 + k


def _start(doc: dict[str, Any], chat: bool) -> int:
    """Where a counting answer begins: after the " wK" its prompt ends with, if any."""
    if chat:
        messages = doc.get("messages") or [{}]
        last = messages[-1]
        if not (doc.get("continue_final_message") and last.get("role") == "assistant"):
            return 0
        tail = str(last.get("content") or "")
    else:
        prompt = doc.get("prompt")
        if isinstance(prompt, list):
            return max(0, int(prompt[-1]) - _FIRST_ID + 1) if prompt else 0
        tail = str(prompt or "")
    m = _COUNTED.search(tail)
    return int(m.group(1)) + 1 if m else 0


def _prompt_words(doc: dict[str, Any]) -> int:
    if "messages" in doc:
        return sum(len(str(m.get("content") or "").split()) for m in doc["messages"])
    prompt = doc.get("prompt")
    return len(prompt) if isinstance(prompt, list) else len(str(prompt or "").split())


@dataclass
class _Counted:
    """One answer of the counting "model": its words and its events, in vLLM's format."""

    doc: dict[str, Any]
    chat: bool
    number: int

    def __post_init__(self) -> None:
        doc = self.doc
        start = _start(doc, self.chat)
        n = int(doc.get("max_completion_tokens") or doc.get("max_tokens") or 16)
        self.start, self.words = start, [f" w{start + i}" for i in range(n)]
        self.obj = "chat.completion.chunk" if self.chat else "text_completion"
        self.top = {
            "id": f"{'chatcmpl' if self.chat else 'cmpl'}-{self.number}",
            "object": self.obj,
            "created": 1_000 + self.number,
            "model": doc.get("model"),
        }
        self.ids = bool(doc.get("return_token_ids"))
        prompt = _prompt_words(doc)
        self.usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        self.prompt_ids = list(range(prompt)) if self.ids else None

    def whole(self) -> dict[str, Any]:
        text = "".join(self.words)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self.top, "choices": [choice], "usage": self.usage}

    def role(self) -> bytes:
        extra = {"prompt_token_ids": self.prompt_ids} if self.ids else {}
        delta = {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return sse({**self.top, **extra, "choices": [choice]})

    def token(self, i: int) -> bytes:
        c: dict[str, Any] = {"index": 0, "logprobs": None}
        c["finish_reason"] = "length" if i == len(self.words) - 1 else None
        if self.chat:
            c["delta"] = {"content": self.words[i]}
        else:
            c.update(text=self.words[i], stop_reason=None, prompt_token_ids=None)
            if i == 0 and self.ids:
                c["prompt_token_ids"] = self.prompt_ids
        c["token_ids"] = [_FIRST_ID + self.start + i] if self.ids else None
        return sse({**self.top, "choices": [c]})

    def tail(self) -> bytes:
        so = self.doc.get("stream_options") or {}
        usage = sse({**self.top, "choices": [], "usage": self.usage})
        return (usage if so.get("include_usage") else b"") + b"data: [DONE]\n\n"


_ENGINE_ERROR: Final = (
    b'data: {"error": {"message": "EngineCore died", "type": "InternalServerError", '
    b'"param": null, "code": 500}}\n\n'
)


def counting(
    *,
    delay: float = 0.0,
    break_after: int | None = None,
    error_after: int | None = None,
    hang_after: int | None = None,
) -> Behaviour:
    """A deterministic "model" that counts: the answer is " w0 w1 w2 ...", one token per
    event, and a prompt (or a continued assistant message) ending in " wK" is answered from
    " wK+1" on, so a stream continued elsewhere can be checked to be seamless. Its vLLM
    chunk format includes ``token_ids`` (" wK" is id 1000 + K) when ``return_token_ids`` is
    asked. After ``break_after`` tokens it resets the connection (a backend that dies);
    after ``error_after`` it sends vLLM's error event and [DONE]; after ``hang_after`` it
    stops sending until ``fake.release`` is set. ``/tokenize`` counts words."""

    def die(request: web.Request) -> None:
        assert request.transport is not None
        request.transport.abort()

    async def behaviour(request: web.Request, fake: FakeBackend, seen: Seen) -> web.StreamResponse:
        fake.counter += 1
        chat = request.path.endswith("/chat/completions")
        answer = _Counted(json.loads(seen.body), chat, fake.counter)
        if not answer.doc.get("stream"):
            if break_after is not None:
                await asyncio.sleep(break_after * delay)  # sleep-ok: generating, then dying
                die(request)
                raise ConnectionResetError
            return web.json_response(answer.whole())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if answer.chat:
            await resp.write(answer.role())
        for i in range(len(answer.words)):
            if i == break_after:
                die(request)
                return resp
            if i == error_after:
                await resp.write(_ENGINE_ERROR + b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            if i == hang_after:
                await fake.release.wait()
            if delay:
                await asyncio.sleep(delay)  # sleep-ok: the scripted pace of the stream
            await resp.write(answer.token(i))
        await resp.write(answer.tail())
        await resp.write_eof()
        return resp

    return behaviour
