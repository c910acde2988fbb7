"""Streams that survive a dying backend, on the simulator under load.

Three simulators behind the gateway (its default policy), 48 streams at once, completions,
chats and Anthropic Messages, some asking for usage; one simulator fails while every stream is
mid-way: killed, its connections reset, stalled, or failing with vLLM's error event. No client
may notice: each gets a 200, no error event, one ``[DONE]`` (or one ``message_stop``), exactly
``max_tokens`` tokens (the simulator's text is random words, one per token, so counts are what
can be checked) and, where asked, usage covering the whole answer. Nothing is left in flight
afterwards, in the gateway or a simulator.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp

from backends.health import Health
from gateway.request.messages import chat_view
from gateway.tokenizer.words import render_chat, tokenize
from tests.anthropic_stream import read_stream
from tests.helpers import RunningGateway, events, running_gateway, sample, wait_for
from tools.sim import FAST, Faults, RunningSim, SimConfig, running_sim

MODEL = FAST.model_name
# About 50 tokens a second for each stream; natural answers (a Messages stream has no
# ignore_eos) longer than any asked for here.
PACED = FAST.replace(step_base_ms=20.0, output_len_min=200)
MAX_TOKENS = 60  # streams of about 1.2 s
STREAMS = 48
MIDWAY = 10  # events every stream has received when the fault hits
CONTINUATIONS = "llm_gateway_stream_continuations_total"
VICTIM = "sim0"


def request(i: int) -> tuple[str, dict[str, Any]]:
    """The ``i``-th request: completions and chats in turn, half of each asking for usage;
    every third one an Anthropic Messages stream (which vLLM runs without ``ignore_eos``:
    the simulator's natural answers are longer than these)."""
    doc: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS + i % 5,
        "stream": True,
    }
    if i % 3 == 2:
        doc["system"] = "You tell stories."
        doc["messages"] = [{"role": "user", "content": f"tell me story number {i}"}]
        return "/v1/messages", doc
    doc["ignore_eos"] = True
    if i % 4 < 2:
        doc["stream_options"] = {"include_usage": True}
    if i % 2:
        doc["messages"] = [{"role": "user", "content": f"tell me story number {i}"}]
        return "/v1/chat/completions", doc
    doc["prompt"] = f"once upon a time number {i}"
    return "/v1/completions", doc


def prompt_tokens(doc: dict[str, Any]) -> int:
    """The prompt's length in the simulator's tokens, as the client's usage must say."""
    if "system" in doc:
        return len(tokenize(render_chat(chat_view(doc)["messages"])))
    if "messages" in doc:
        return len(tokenize(render_chat(doc["messages"])))
    return len(tokenize(doc["prompt"]))


class Load:
    """``STREAMS`` streaming requests at once through the gateway, read as they arrive."""

    def __init__(self, gw: RunningGateway) -> None:
        self.gw = gw
        self.requests = [request(i) for i in range(STREAMS)]
        self.received = [bytearray() for _ in self.requests]
        self.statuses: list[int | None] = [None] * STREAMS

    def midway(self, queued: int = 0) -> bool:
        """Every stream but ``queued`` ones has received ``MIDWAY`` events."""
        return sum(r.count(b"\n\n") >= MIDWAY for r in self.received) >= STREAMS - queued

    async def run(self) -> None:
        async with aiohttp.ClientSession() as client:
            await asyncio.gather(*(self._one(client, i) for i in range(STREAMS)))

    async def _one(self, client: aiohttp.ClientSession, i: int) -> None:
        path, doc = self.requests[i]
        async with client.post(self.gw.url + path, json=doc) as resp:
            self.statuses[i] = resp.status
            async for chunk in resp.content.iter_any():
                self.received[i] += chunk

    def check(self) -> None:
        """What every client must have seen: a whole answer, as if nothing had broken."""
        for i, ((path, doc), raw) in enumerate(zip(self.requests, self.received, strict=True)):
            what = f"request {i} ({path}, max_tokens {doc['max_tokens']})"
            assert self.statuses[i] == 200, (what, bytes(raw[:300]))
            if path == "/v1/messages":
                stream = read_stream(bytes(raw))  # valid under Anthropic's format, or raises
                assert stream.error is None, (what, stream.error)
                assert len(stream.text.split()) == doc["max_tokens"], (what, "every token, once")
                assert stream.stop_reason == "max_tokens", what
                assert stream.usage == {
                    "input_tokens": prompt_tokens(doc),
                    "output_tokens": doc["max_tokens"],
                }, what
                continue
            evs = events(bytes(raw))
            assert evs.count("[DONE]") == 1, what
            assert evs[-1] == "[DONE]", what
            chunks = evs[:-1]
            assert not [e for e in chunks if "error" in e], (what, "an error event reached it")
            assert len({e["id"] for e in chunks}) == 1, (what, "one stream, one id")
            choices = [c for e in chunks for c in e["choices"]]
            pieces = (c.get("text") or c.get("delta", {}).get("content") or "" for c in choices)
            text = "".join(pieces)
            assert len(text.split()) == doc["max_tokens"], (what, "every token, once")
            finishes = [c["finish_reason"] for c in choices if c.get("finish_reason")]
            assert finishes == ["length"], what
            if "messages" in doc:
                roles = [c for c in choices if "role" in c.get("delta", {})]
                assert len(roles) == 1, (what, "one role chunk")
            usage = [e["usage"] for e in chunks if not e["choices"] and e.get("usage")]
            if "stream_options" not in doc:
                assert usage == [], (what, "usage it did not ask for")
                continue
            assert len(usage) == 1, what
            n_prompt = prompt_tokens(doc)
            assert usage[0] == {
                "prompt_tokens": n_prompt,
                "completion_tokens": doc["max_tokens"],
                "total_tokens": n_prompt + doc["max_tokens"],
            }, what


def continuations(gw: RunningGateway) -> dict[tuple[str, str], float]:
    """``(reason, outcome)`` to count, for every continuation series that is not zero."""
    out: dict[tuple[str, str], float] = {}
    for family in gw.svc.metrics.registry.collect():
        for s in family.samples:
            if s.name == CONTINUATIONS and s.value:
                out[(s.labels["reason"], s.labels["outcome"])] = s.value
    return out


def retries_from(gw: RunningGateway, backend: str) -> float:
    """Attempts on ``backend`` that failed before their first byte and went elsewhere."""
    return sum(
        s.value
        for family in gw.svc.metrics.registry.collect()
        for s in family.samples
        if s.name == "llm_gateway_retries_total" and s.labels["backend"] == backend
    )


@asynccontextmanager
async def fleet(
    victim: SimConfig = PACED, victim_faults: Faults | None = None, **overrides: Any
) -> AsyncIterator[tuple[RunningGateway, list[RunningSim], list[Health]]]:
    """Three simulators (the first one, ``sim0``, to be failed) behind a gateway that has
    seen them all up; and the victim's health states, as they change."""
    configs = [(victim, victim_faults), (PACED, None), (PACED, None)]
    async with AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(running_sim(c, f)) for c, f in configs]
        backends = [{"url": s.url, "name": f"sim{i}"} for i, s in enumerate(sims)]
        gw = await stack.enter_async_context(running_gateway(backends, **overrides))
        pool = gw.svc.pool
        await wait_for(
            lambda: all(pool.routable(b, pool.now()) for b in pool.all()), what="backends up"
        )
        victim_state = pool.get(VICTIM)
        assert victim_state is not None
        seen: list[Health] = []
        pool.on_change(lambda: seen.append(victim_state.health.state))
        yield gw, sims, seen


async def survive(
    gw: RunningGateway,
    sims: list[RunningSim],
    fault: Callable[[], Any] | None = None,
    queued: Callable[[], int] = lambda: 0,
) -> None:
    """Run the load; once every stream (but the ``queued()`` ones) is mid-way, ``fault()``
    (awaited if need be). Check every client's answer and that nothing is left anywhere."""
    load = Load(gw)
    run = asyncio.create_task(load.run())
    try:
        if fault is not None:
            await wait_for(lambda: load.midway(queued()), within=20, what="streams mid-way")
            assert not run.done()
            injected = fault()
            if asyncio.iscoroutine(injected):
                await injected
        async with asyncio.timeout(20):  # a hang fails here, not at the test's timeout
            await run
    finally:
        run.cancel()
    load.check()
    assert sum(s.engine.stats.generation_tokens for s in sims[1:]) > 0
    await wait_for(lambda: set(gw.in_flight().values()) == {0}, what="no lease left")
    await wait_for(
        lambda: all(s.state.in_flight == 0 and not s.engine.has_work() for s in sims),
        what="no simulator still running a request",
    )


def continued(gw: RunningGateway) -> float:
    """Streams another backend finished; fails if any stream ended otherwise."""
    counts = continuations(gw)
    assert {outcome for _, outcome in counts} <= {"continued", "complete"}, counts
    return sum(n for (_, outcome), n in counts.items() if outcome == "continued")


async def test_a_killed_backend_loses_no_request_before_or_during_its_streams() -> None:
    # The victim runs 4 streams at a time: the others wait in its queue, headers sent but no
    # token yet, when it dies (retried before their first byte; the 4 continued elsewhere).
    async with fleet(PACED.replace(max_num_seqs=4)) as (gw, sims, seen):
        victim = sims[0]

        async def kill() -> None:
            assert victim.engine.waiting, "no request waiting on the victim: no pre-stream case"
            await victim.kill()

        await survive(gw, sims, kill, queued=lambda: len(victim.engine.waiting))
        n = sample(gw, CONTINUATIONS, reason="unreachable", outcome="continued")
        assert n > 0
        assert continued(gw) == n
        assert retries_from(gw, VICTIM) > 0
        assert Health.DOWN in seen


async def test_connections_reset_mid_stream_lose_no_request() -> None:
    async with fleet(victim_faults=Faults(break_after_tokens=15)) as (gw, sims, _):
        await survive(gw, sims)
        n = sample(gw, CONTINUATIONS, reason="unreachable", outcome="continued")
        assert n > 0
        assert continued(gw) == n
        assert sims[0].engine.stats.aborted["decode"] > 0  # its streams were cut, and freed


async def test_a_stalled_backend_is_taken_out_and_loses_no_request() -> None:
    # The idle timeout is past any run: a stream cut is the stall's doing (reason "stalled").
    overrides = {"health": {"stall_after": 1.0}, "upstream": {"idle_timeout": 3600}}
    async with fleet(**overrides) as (gw, sims, seen):
        victim = sims[0]

        def stall() -> None:
            victim.faults = Faults(hang_after_tokens=MIDWAY)  # its streams are past it

        await survive(gw, sims, stall)
        assert sample(gw, "llm_gateway_backend_stalls_total", backend=VICTIM) == 1
        assert Health.DOWN in seen
        n = sample(gw, CONTINUATIONS, reason="stalled", outcome="continued")
        assert n > 0
        assert continued(gw) == n


async def test_an_engine_error_mid_stream_reaches_no_client() -> None:
    async with fleet(victim_faults=Faults(error_after_tokens=20)) as (gw, sims, _):
        await survive(gw, sims)
        n = sample(gw, CONTINUATIONS, reason="engine_error", outcome="continued")
        assert n > 0
        assert continued(gw) == n
