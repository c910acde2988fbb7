"""A stream whose backend fails mid-way goes on from another backend (issue 18).

The fake backends run the counting "model" (``loadtest.counting``): its answer is
" w0 w1 w2 ...", and a prompt ending in " wK" is answered from " wK+1" on, so the stitched
stream can be checked word for word against an answer that never broke.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from backends.health import Health
from loadtest.counting import counting
from tests.helpers import (
    FakeBackend,
    RunningGateway,
    events,
    fronting,
    sample,
    wait_for,
)
from tools.fake_vllm import Behaviour, Seen, sse

MAX = 20
WHOLE = "".join(f" w{i}" for i in range(MAX))  # the answer of a stream that never broke
PROMPT = "count with me"
COMPLETION = {"model": "m", "prompt": PROMPT, "max_tokens": MAX, "stream": True}
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": PROMPT}],
    "max_tokens": MAX,
    "stream": True,
}
USAGE = {"stream_options": {"include_usage": True}}
CONTINUATIONS = "llm_gateway_stream_continuations_total"


@asynccontextmanager
async def fleet(
    *behaviours: Behaviour, **overrides: Any
) -> AsyncIterator[tuple[RunningGateway, list[FakeBackend]]]:
    """Fakes with these behaviours, tried in the order given (round robin from the first)."""
    fakes = [FakeBackend(behaviour=b) for b in behaviours]
    overrides.setdefault("policy", "round_robin")
    async with fronting(*fakes, **overrides) as gw:
        yield gw, fakes


async def post(gw: RunningGateway, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(gw.url + path, json=body) as r:
        return r.status, await asyncio.wait_for(r.read(), 20)


def text_of(evs: Sequence[Any]) -> str:
    out = []
    for e in evs:
        if isinstance(e, dict):
            for c in e.get("choices", []):
                out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(out)


def sent_json(fake: FakeBackend, n: int = -1) -> dict[str, Any]:
    return json.loads(fake.seen[n].body)


def no_leaks(gw: RunningGateway) -> bool:
    return set(gw.in_flight().values()) <= {0}


async def test_a_completion_whose_backend_dies_goes_on_from_another_without_a_seam() -> None:
    async with fleet(counting(break_after=5), counting()) as (gw, (_, b)):
        status, raw = await post(gw, "/v1/completions", {**COMPLETION, **USAGE})
        assert status == 200
        evs = events(raw)
        assert text_of(evs) == WHOLE  # nothing missing, nothing repeated
        assert not any(isinstance(e, dict) and "error" in e for e in evs)
        assert evs.count("[DONE]") == 1
        assert evs[-1] == "[DONE]"
        chunks = [e for e in evs if isinstance(e, dict)]
        assert {(e["id"], e["created"]) for e in chunks} == {("cmpl-1", 1001)}  # a's, throughout
        usage = [e["usage"] for e in chunks if e.get("usage")]
        assert usage == [{"prompt_tokens": 3, "completion_tokens": MAX, "total_tokens": 3 + MAX}]
        # b was asked for the rest: the prompt and what a had sent, the budget lowered by it.
        rest = sent_json(b)
        assert rest["prompt"] == PROMPT + " w0 w1 w2 w3 w4"
        assert rest["max_tokens"] == MAX - 5
        assert rest["stream_options"]["include_usage"] is True
        assert b.tokenized == [
            {"model": "m", "prompt": " w0 w1 w2 w3 w4", "add_special_tokens": False}
        ]
        assert sample(gw, CONTINUATIONS, reason="unreachable", outcome="continued") == 1
        assert no_leaks(gw)


async def test_a_chat_stream_continues_the_partial_assistant_message() -> None:
    async with fleet(counting(break_after=7), counting()) as (gw, (_, b)):
        status, raw = await post(gw, "/v1/chat/completions", CHAT)
        assert status == 200
        evs = events(raw)
        assert text_of(evs) == WHOLE
        roles = [e for e in evs if isinstance(e, dict) and "role" in e["choices"][0]["delta"]]
        assert len(roles) == 1  # b's own role chunk is not repeated to the client
        assert not any(isinstance(e, dict) and e.get("usage") for e in evs)  # not asked for
        assert evs.count("[DONE]") == 1
        rest = sent_json(b)
        assert rest["messages"][-1] == {"role": "assistant", "content": " w0 w1 w2 w3 w4 w5 w6"}
        assert rest["continue_final_message"] is True
        assert rest["add_generation_prompt"] is False
        assert rest["max_tokens"] == MAX - 7
        assert {e["id"] for e in evs if isinstance(e, dict)} == {"chatcmpl-1"}


async def test_with_token_ids_the_continuation_is_sent_as_exact_token_ids() -> None:
    async with fleet(counting(break_after=4), counting()) as (gw, (_, b)):
        body = {**COMPLETION, **USAGE, "return_token_ids": True}
        status, raw = await post(gw, "/v1/completions", body)
        assert status == 200
        evs = events(raw)
        assert text_of(evs) == WHOLE
        ids = [i for e in evs if isinstance(e, dict) for c in e["choices"] for i in c["token_ids"]]
        assert ids == [1000 + i for i in range(MAX)]
        rest = sent_json(b)
        assert rest["prompt"] == [0, 1, 2, 1000, 1001, 1002, 1003]  # the prompt's ids, then a's
        assert b.tokenized == []  # the ids were counted: nothing to ask
        prompt_ids = [
            c.get("prompt_token_ids") for e in evs if isinstance(e, dict) for c in e["choices"]
        ]
        assert [p for p in prompt_ids if p] == [[0, 1, 2]]  # once, as the first backend sent it


async def test_an_error_event_from_the_engine_is_continued_not_shown() -> None:
    async with fleet(counting(error_after=6), counting()) as (gw, _):
        status, raw = await post(gw, "/v1/completions", COMPLETION)
        assert status == 200
        assert b"EngineCore died" not in raw
        assert text_of(events(raw)) == WHOLE
        assert sample(gw, CONTINUATIONS, reason="engine_error", outcome="continued") == 1


async def test_a_continuation_that_breaks_is_continued_again() -> None:
    # Round robin: a first, then its continuation on the third, then the second.
    behaviours = (counting(break_after=3), counting(), counting(break_after=5))
    async with fleet(*behaviours) as (gw, (_, b, c)):
        status, raw = await post(gw, "/v1/completions", {**COMPLETION, **USAGE})
        assert status == 200
        evs = events(raw)
        assert text_of(evs) == WHOLE
        usage = [e["usage"] for e in evs if isinstance(e, dict) and e.get("usage")]
        assert [u["completion_tokens"] for u in usage] == [MAX]
        assert sent_json(c)["prompt"] == PROMPT + " w0 w1 w2"
        assert sent_json(b)["prompt"] == PROMPT + "".join(f" w{i}" for i in range(8))
        assert sample(gw, CONTINUATIONS, reason="unreachable", outcome="broken") == 1
        assert sample(gw, CONTINUATIONS, reason="unreachable", outcome="continued") == 1
        assert no_leaks(gw)


async def test_past_the_limit_a_break_ends_the_stream_with_the_error_event() -> None:
    behaviours = (counting(break_after=3), counting(), counting(break_after=3))
    async with fleet(*behaviours, continuation={"max_continuations": 1}) as (gw, (_, b, _)):
        status, raw = await post(gw, "/v1/completions", COMPLETION)
        assert status == 200
        evs = events(raw)
        assert text_of(evs) == " w0 w1 w2 w3 w4 w5"  # what a and c sent, nothing more
        assert evs[-2]["error"]["type"] == "bad_gateway"
        assert evs[-1] == "[DONE]"
        assert b.seen == []
        assert sample(gw, CONTINUATIONS, reason="unreachable", outcome="limit") == 1
        assert no_leaks(gw)


async def test_when_no_backend_can_continue_the_stream_ends_as_before() -> None:
    async with fleet(counting(break_after=3), counting(break_after=0)) as (gw, _):
        status, raw = await post(gw, "/v1/completions", COMPLETION)
        assert status == 200
        evs = events(raw)
        assert text_of(evs) == " w0 w1 w2"
        assert "error" in evs[-2]
        assert evs[-1] == "[DONE]"
        assert sample(gw, CONTINUATIONS, reason="unreachable", outcome="failed") == 1
        assert no_leaks(gw)


async def test_what_cannot_be_continued_faithfully_ends_with_the_error_event() -> None:
    async with fleet(counting(break_after=3), counting(break_after=3)) as (gw, fakes):
        for extra in ({"n": 2}, {"logprobs": 1}, {"echo": True}):
            status, raw = await post(gw, "/v1/completions", {**COMPLETION, **extra})
            assert status == 200
            assert "error" in events(raw)[-2], extra
        assert sum(len(f.seen) for f in fakes) == 3  # one backend each: none was continued
        assert sample(gw, CONTINUATIONS, reason="unreachable", outcome="failed") == 0


async def test_when_continuations_are_off_a_break_ends_the_stream() -> None:
    async with fleet(counting(break_after=3), counting(), continuation={"enabled": False}) as (
        gw,
        (_, b),
    ):
        status, raw = await post(gw, "/v1/completions", COMPLETION)
        assert status == 200
        assert "error" in events(raw)[-2]
        assert b.seen == []


async def test_a_stalled_backend_is_taken_out_and_its_streams_finish_elsewhere() -> None:
    slow = counting(delay=0.01, hang_after=5)
    health = {"stall_after": 0.4, "rise": 2}
    async with fleet(slow, counting(delay=0.01), health=health) as (gw, (a, _)):
        state = gw.svc.pool.get(a.url[7:])
        assert state is not None
        seen: list[Health] = []
        gw.svc.pool.on_change(lambda: seen.append(state.health.state))
        # Round robin: two of the four streams on a, which stops after five tokens. Both are
        # cut at the stall limit (well before the idle timeout) and finish on b.
        results = await asyncio.gather(*(post(gw, "/v1/completions", COMPLETION) for _ in range(4)))
        for status, raw in results:
            assert status == 200
            assert text_of(events(raw)) == WHOLE
        assert sample(gw, "llm_gateway_backend_stalls_total", backend=a.url[7:]) == 1
        assert sample(gw, CONTINUATIONS, reason="stalled", outcome="continued") == 2
        assert Health.DOWN in seen  # out of rotation...
        # ...and back through its probes (it answers /health all along).
        a.release.set()
        await wait_for(lambda: state.health.state is Health.UP, what="a back up")
        assert no_leaks(gw)


async def test_a_non_stream_request_whose_backend_dies_mid_generation_is_retried() -> None:
    async with fleet(counting(delay=0.01, break_after=5), counting()) as (gw, (a, b)):
        status, raw = await post(gw, "/v1/completions", {**COMPLETION, "stream": False})
        assert status == 200
        assert json.loads(raw)["choices"][0]["text"] == WHOLE
        assert len(a.seen) == 1
        assert len(b.seen) == 1


async def test_a_client_that_leaves_during_a_continuation_leaves_nothing_behind() -> None:
    async with fleet(counting(break_after=3), counting(delay=0.05)) as (gw, (_, b)):
        async with aiohttp.ClientSession() as s:
            r = await s.post(gw.url + "/v1/completions", json=COMPLETION)
            await r.content.readuntil(b" w5")  # b is streaming the rest
            r.close()
        await wait_for(lambda: b.seen[-1].ending == "cancelled", what="b's generation aborted")
        await wait_for(lambda: no_leaks(gw), what="no lease left")
        ends = "llm_gateway_upstream_aborts_total"
        assert sample(gw, ends, backend=b.url[7:], reason="client_disconnect") == 1


async def test_a_stream_that_breaks_after_its_finish_is_ended_not_continued() -> None:
    async def finished_then_dead(request: web.Request, fake: FakeBackend, seen: Seen) -> Any:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"id": "x", "choices": [{"index": 0, "text": " w0"}]}))
        last = {"index": 0, "text": " w1", "finish_reason": "length"}
        await resp.write(sse({"id": "x", "choices": [last]}))
        assert request.transport is not None
        request.transport.abort()  # before the usage chunk and [DONE]
        return resp

    async with fleet(finished_then_dead, counting()) as (gw, (_, b)):
        status, raw = await post(gw, "/v1/completions", {**COMPLETION, "max_tokens": 2})
        assert status == 200
        evs = events(raw)
        assert text_of(evs) == " w0 w1"
        assert evs[-1] == "[DONE]"
        assert not any(isinstance(e, dict) and "error" in e for e in evs)
        assert b.seen == []  # nothing was left to generate
        assert sample(gw, CONTINUATIONS, reason="unreachable", outcome="complete") == 1
