"""vLLM's own answers to ``/v1/chat/completions`` and ``/v1/completions``, paced like an engine.

Timing: the first token ``ttft`` after the request arrives, token *i* at ``ttft + i x itl`` on
an absolute schedule (no drift); ``itl`` 0 sends as fast as it can, still yielding to the loop
between tokens so that concurrent streams interleave like an engine's steps.

Bytes: vLLM's OpenAI server's (pydantic, ``exclude_unset``). Every chunk of an answer carries
its id (``chatcmpl-<hex>`` / ``cmpl-<hex>``, one per request) and ``created`` second; a chat
stream opens with a ``delta {"role": "assistant", "content": ""}`` chunk; one chunk a token,
the last with ``finish_reason "length"`` and ``stop_reason null``; the usage chunk
(``choices []``) when ``stream_options.include_usage``; then ``[DONE]``. Tokens are the words
of a 16-word sentence, ``max_tokens`` (or ``max_completion_tokens``; 16 if neither) of them.

Cheap by construction, since the benchmarks run it on the load generator's core: an answer's
chunks are formatted once (one per distinct word), so a token costs a list lookup and a write.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

from tools.fake_vllm.backend import Behaviour, FakeBackend, Seen

WORDS: Final = (
    " the", " quick", " brown", " fox", " jumps", " over", " a", " lazy",
    " dog", " and", " then", " runs", " far", " away", " again", ".",
)  # fmt: skip
_WORDS_JSON: Final = tuple(json.dumps(w)[1:-1] for w in WORDS)  # escaped, without quotes
DEFAULT_MAX_TOKENS: Final = 16
DONE: Final = b"data: [DONE]\n\n"
_SSE_HEADERS: Final = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
}


class BadRequest(ValueError):
    """A body vLLM would answer with 400."""


@dataclass(frozen=True, slots=True)
class Asked:
    """What a completion request asks for, as far as this fake answers it."""

    chat: bool
    model: Any
    tokens: int
    stream: bool
    include_usage: bool
    prompt_tokens: int


def asked(body: bytes, *, chat: bool, default_model: str) -> Asked:
    """Read a completion request's body; ``BadRequest`` for what vLLM would refuse."""
    try:
        doc = json.loads(body)
    except ValueError:
        raise BadRequest("invalid JSON body") from None
    if not isinstance(doc, dict):
        raise BadRequest("body must be an object")
    n: Any = doc.get("max_tokens", doc.get("max_completion_tokens", DEFAULT_MAX_TOKENS))
    try:
        tokens = max(1, int(n))
    except (TypeError, ValueError):
        raise BadRequest("max_tokens must be an integer") from None
    options = doc.get("stream_options") or {}
    return Asked(
        chat=chat,
        model=doc.get("model") or default_model,
        tokens=tokens,
        stream=bool(doc.get("stream", False)),
        include_usage=isinstance(options, dict) and bool(options.get("include_usage", False)),
        prompt_tokens=prompt_length(doc, chat),
    )


def prompt_length(doc: dict[str, Any], chat: bool) -> int:
    """The prompt's tokens as this fake counts them: words (and 4 a chat message)."""
    try:
        if chat:
            n = 0
            for m in doc.get("messages") or []:
                c = m.get("content")
                if isinstance(c, str):
                    n += len(c.split()) + 4
                elif isinstance(c, list):
                    for part in c:
                        if isinstance(part, dict) and isinstance(part.get("text"), str):
                            n += len(part["text"].split())
            return max(n, 1)
        p = doc.get("prompt", "")
        if isinstance(p, list):
            if p and isinstance(p[0], int):
                return len(p)
            return max(sum(len(str(x).split()) for x in p), 1)
        return max(len(str(p).split()), 1)
    except Exception:  # a prompt of an odd shape: the fake answers it all the same
        return 1


@dataclass(frozen=True, slots=True)
class Chunks:
    """One streamed answer's events: ``opening`` (chat's role chunk, or none), ``tokens`` (the
    chunk of each distinct word; token *i* is ``tokens[i % len(tokens)]``), ``last`` (the last
    token's, with its finish reason) and ``usage`` (or none)."""

    opening: bytes | None
    tokens: tuple[bytes, ...]
    last: bytes
    usage: bytes | None

    def token(self, i: int, n: int) -> bytes:
        return self.last if i == n - 1 else self.tokens[i % len(self.tokens)]


def chunks(a: Asked, rid: str, created: int) -> Chunks:
    """The events of ``a``'s answer, in vLLM's bytes."""
    obj = "chat.completion.chunk" if a.chat else "text_completion"
    head = (
        f'data: {{"id":"{rid}","object":"{obj}","created":{created},"model":{json.dumps(a.model)},'
    )
    choice = head + '"choices":[{"index":0,'
    if a.chat:
        before, after = '"delta":{"content":"', '"},"logprobs":null,"finish_reason":'
        tail, last_tail = "null}]}\n\n", '"length","stop_reason":null}]}\n\n'
    else:
        before, after = '"text":"', '","logprobs":null,"finish_reason":'
        tail, last_tail = 'null,"stop_reason":null}]}\n\n', '"length","stop_reason":null}]}\n\n'
    prefix, middle = choice + before, after
    opening = None
    if a.chat:
        role = '"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}'
        opening = (choice + role + "\n\n").encode()
    distinct = _WORDS_JSON[: min(a.tokens, len(_WORDS_JSON))]
    word = _WORDS_JSON[(a.tokens - 1) % len(_WORDS_JSON)]
    usage = None
    if a.include_usage:
        p, n = a.prompt_tokens, a.tokens
        counts = f'"prompt_tokens":{p},"total_tokens":{p + n},"completion_tokens":{n}'
        usage = (head + '"choices":[],"usage":{' + counts + "}}\n\n").encode()
    return Chunks(
        opening=opening,
        tokens=tuple((prefix + w + middle + tail).encode() for w in distinct),
        last=(prefix + word + middle + last_tail).encode(),
        usage=usage,
    )


def whole(a: Asked, rid: str, created: int) -> dict[str, Any]:
    """The answer of ``a`` not streamed, as vLLM's JSON."""
    text = "".join(WORDS[i % len(WORDS)] for i in range(a.tokens))
    p, n = a.prompt_tokens, a.tokens
    choice: dict[str, Any] = {"index": 0}
    if a.chat:
        choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
    else:
        choice["text"] = text
    choice.update(logprobs=None, finish_reason="length", stop_reason=None)
    return {
        "id": rid,
        "object": "chat.completion" if a.chat else "text_completion",
        "created": created,
        "model": a.model,
        "choices": [choice],
        "usage": {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n},
    }


def vllm(ttft: float = 0.0, itl: float = 0.0) -> Behaviour:
    """vLLM's answers, the first token after ``ttft`` s, then one per ``itl`` s (0: as fast as
    it can); keeps the fake's counters (``finished``, ``prompt_tokens``,
    ``generation_tokens``) as vLLM's ``/metrics`` does."""

    async def behaviour(request: web.Request, fake: FakeBackend, seen: Seen) -> web.StreamResponse:
        t0 = time.perf_counter()
        chat = request.path.endswith("/chat/completions")
        try:
            a = asked(seen.body, chat=chat, default_model=fake.models[0])
        except BadRequest as e:
            return _error(400, str(e))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if not a.stream:
            await _until(t0 + ttft + (a.tokens - 1) * itl)
            fake.finished += 1
            fake.prompt_tokens += a.prompt_tokens
            fake.generation_tokens += a.tokens
            return web.json_response(whole(a, rid, created))
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        events = chunks(a, rid, created)
        n = a.tokens
        first = t0 + ttft
        sent = 0
        try:
            await _until(first)
            if events.opening is not None:
                await resp.write(events.opening)
            for i in range(n):
                if i:  # the wait inline, not in _until: a coroutine less a token
                    delay = first + i * itl - time.perf_counter() if itl > 0 else 0
                    await asyncio.sleep(delay if delay > 0 else 0)  # sleep-ok: the schedule
                await resp.write(events.token(i, n))
                sent += 1
            if events.usage is not None:
                await resp.write(events.usage)
            await resp.write(DONE)
            await resp.write_eof()
            fake.finished += 1
        finally:
            fake.prompt_tokens += a.prompt_tokens
            fake.generation_tokens += sent
        return resp

    return behaviour


async def _until(t: float) -> None:
    delay = t - time.perf_counter()
    await asyncio.sleep(delay if delay > 0 else 0)  # sleep-ok: the paced token schedule


def _error(status: int, message: str) -> web.Response:
    doc = {"object": "error", "message": message, "type": "BadRequestError", "param": None}
    return web.json_response({**doc, "code": status}, status=status)
