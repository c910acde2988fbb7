"""A stream whose vLLM server is SIGKILLed mid-way goes on from the other server (issue 18).

The official ``openai`` client reads a long greedy stream through the gateway; once it has
received part of it, the server producing it is killed (its whole process group, SIGKILL).
The client must get every token by the usage chunk and no error; the answer is compared,
token for token, with the same request run without a kill. Each test restarts the server it
killed, so the session's two servers are there for the tests that follow.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import openai
import pytest

from backends.state import BackendSpec
from tests.e2e.servers import SERVED_MODEL, START_DEADLINE, VllmServer, kill, restart
from tests.helpers import RunningGateway, sample, wait_for

# Each test restarts the server it killed, within the test: a vLLM server's start (about a
# minute on two busy cores) on top of two 2,000-token answers (about 15 s each) is more than
# the usual 60 s per test, and the rerun it then needed only hid that.
pytestmark = pytest.mark.timeout(START_DEADLINE + 120)

N_TOKENS = 2000
KILL_AFTER = 20  # chunks received before the server producing them is killed
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": N_TOKENS}
EXACT = {"ignore_eos": True, "return_token_ids": True}
USAGE = {"include_usage": True}
PROMPT = "The gateway keeps the stream alive:"
MESSAGES: list[Any] = [{"role": "user", "content": PROMPT}]


def extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


def serving(gw: RunningGateway, servers: list[VllmServer]) -> VllmServer:
    """The server the gateway has a request in flight to (there is one request)."""
    busy = [b.spec.url for b in gw.svc.pool.all() if b.in_flight]
    assert len(busy) == 1, busy
    return next(s for s in servers if s.url == busy[0])


def seam(reference: list[int], stitched: list[int]) -> int | None:
    """The first token position where the two answers differ (None: identical)."""
    for i, (x, y) in enumerate(zip(reference, stitched, strict=False)):
        if x != y:
            return i
    return None if len(reference) == len(stitched) else min(len(reference), len(stitched))


class TooLate(Exception):
    """vLLM had sent the whole stream before the client read ``KILL_AFTER`` chunks (its API
    server starved of CPU on a busy two-core machine bursts its output at the end)."""


class Killer:
    """Reads a stream, killing the server producing it after ``KILL_AFTER`` chunks; the
    ``killing`` block restarts whatever it killed, however the test ended."""

    def __init__(self, gw: RunningGateway, servers: list[VllmServer]) -> None:
        self.gw, self.servers = gw, servers
        self.victim: VllmServer | None = None

    async def read(self, chunks: Any) -> tuple[Any, list[int]]:
        """The stream's usage and every token id it carried."""
        usage, ids, n = None, [], 0
        async for chunk in chunks:
            n += 1
            if n == KILL_AFTER:
                busy = [b.spec.url for b in self.gw.svc.pool.all() if b.in_flight]
                if not busy:  # the whole answer is already at the gateway: nothing to cut
                    raise TooLate(n)
                self.victim = serving(self.gw, self.servers)
                await asyncio.to_thread(kill, self.victim)
            for choice in chunk.choices:
                ids.extend(extra(choice, "token_ids") or [])
            usage = chunk.usage or usage
        assert self.victim is not None, f"the stream ended after {n} chunks, before the kill"
        return usage, ids


@asynccontextmanager
async def killing(gw: RunningGateway, servers: list[VllmServer]) -> AsyncIterator[Killer]:
    """Restarts whatever the killer killed, however the block ended, and tells the gateway:
    a restarted server listens on a new port, and a run redone after a kill that cut nothing
    needs both servers again (with only the survivor, its kill would leave nowhere to go)."""
    killer = Killer(gw, servers)
    try:
        yield killer
    finally:
        if killer.victim is not None:
            old = killer.victim
            fresh = await asyncio.to_thread(restart, servers, old)
            pool, monitor = gw.svc.pool, gw.svc.monitor
            gone = next(b.id for b in pool.all() if b.spec.url == old.url)
            pool.remove(gone)
            monitor.unwatch(gone)
            monitor.watch(
                pool.add(BackendSpec(id=fresh.url.removeprefix("http://"), url=fresh.url))
            )
            await wait_for(
                lambda: all(pool.routable(b, pool.now()) for b in pool.all()),
                within=30.0,
                what="the restarted server routable",
            )


def continued(gw: RunningGateway) -> float:
    name = "llm_gateway_stream_continuations_total"
    return sample(gw, name, reason="unreachable", outcome="continued")


async def uninterrupted_and_killed(
    create: Any, gateway: RunningGateway, servers: list[VllmServer]
) -> tuple[list[int], list[int]]:
    """``create`` (an openai ``create`` with its request) run once whole, then as a stream
    whose server is killed mid-way; the usage the stream ended with must be the whole
    answer's, with no error (the SDK raises on an error event). Returns the uninterrupted
    answer's token ids and the stream's."""
    whole = await create(extra_body=EXACT)
    reference = extra(whole.choices[0], "token_ids")
    assert len(reference) == N_TOKENS
    for attempt in range(3):  # a run where the kill came too late proves nothing: again
        before = continued(gateway)
        stream = await create(stream=True, stream_options=USAGE, extra_body=EXACT)
        try:
            async with killing(gateway, servers) as killer:
                usage, ids = await killer.read(stream)
            assert usage is not None
            assert usage.completion_tokens == N_TOKENS
            assert len(ids) == N_TOKENS
            assert usage.prompt_tokens == whole.usage.prompt_tokens  # the original prompt's
            if continued(gateway) == before + 1:
                return reference, ids
            # The kill cut nothing: vLLM had already sent the whole answer, which the gateway
            # was still relaying (the answer is whole, as checked above).
            late: Exception = TooLate(KILL_AFTER)
        except TooLate as exc:
            await stream.close()
            late = exc
        if attempt == 2:
            raise AssertionError(
                f"three times vLLM had sent the whole stream before the kill ({late} chunks)"
            ) from late
    raise AssertionError("unreachable")


async def test_a_completion_stream_survives_its_server_being_killed(
    client: openai.AsyncOpenAI, gateway: RunningGateway, servers: list[VllmServer]
) -> None:
    create = partial(client.completions.create, model=SERVED_MODEL, prompt=PROMPT, **GREEDY)
    reference, ids = await uninterrupted_and_killed(create, gateway, servers)
    # Token ids were sent back as the prompt: the continuation is the same greedy answer.
    at = seam(reference, ids)
    print(f"completion: {N_TOKENS} tokens, first difference from the uninterrupted answer: {at}")
    assert at is None


async def test_a_chat_stream_survives_its_server_being_killed(
    client: openai.AsyncOpenAI, gateway: RunningGateway, servers: list[VllmServer]
) -> None:
    create = partial(
        client.chat.completions.create, model=SERVED_MODEL, messages=MESSAGES, **GREEDY
    )
    reference, ids = await uninterrupted_and_killed(create, gateway, servers)
    # The partial message was sent back as text (chat takes no token ids): the tokenizer may
    # split that text differently from how it was generated, and the greedy answer may then go
    # another way from there. Said, not asserted (in our runs it did not: no difference).
    at = seam(reference, ids)
    print(f"chat: {N_TOKENS} tokens, first difference from the uninterrupted answer: {at}")
