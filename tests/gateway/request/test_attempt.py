"""The attempt loop (``gateway/request/attempt.py``) in memory, on the transport seam
(``MockTransport``): each decision it takes, and what it tells the policy.

No backend server runs: each backend is a function, so every test reads what the loop decided
from what the transport saw (which backends were asked, in which order, with which bodies),
from what the client got, and from the outcomes the policy was told (a refusal, a connection
refused, a cut stream, a client that leaves). Timeouts are tiny values and a stuck backend
waits on an event that never comes, so nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from backends.upstream.mock import MockRequest, MockResponse, MockTransport
from gateway.request import call
from policies import PrefixAffinity
from tests.helpers import RunningGateway, events, running_gateway, sample, wait_for
from tests.mock_fleet import Answer, Fleet, InOrder, chunk

BACKENDS = [{"url": f"http://{n}.invalid:8000", "name": n} for n in ("a", "b", "c")]
CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "count"}],
    "max_tokens": 5,
    "stream": True,
}
PLAIN: dict[str, Any] = {**CHAT, "stream": False}
# A prompt long enough to have prefix blocks for prefix_affinity to remember.
LONG: dict[str, Any] = {**CHAT, "messages": [{"role": "user", "content": "hi " * 40}]}
NO_BACKOFF = {"backoff_base": 0}


def delta(content: str) -> bytes:
    return chunk({"choices": [{"index": 0, "delta": {"content": content}}]})


async def words(
    *texts: str,
    cut: bool = False,
    hold: asyncio.Event | None = None,
    ended: list[str] | None = None,
    name: str = "",
) -> AsyncIterator[bytes]:
    """An SSE chat stream of ``texts``; ``cut``: the backend dies after them; ``hold``: the
    stream waits on it after its first text. ``ended`` is told ``name`` however the stream
    ends (read to its end, or closed by the gateway)."""
    try:
        yield chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i, text in enumerate(texts):
            if hold is not None and i == 1:
                await hold.wait()
            yield delta(text)
        if cut:
            raise ConnectionResetError("the backend died")
        usage = {"prompt_tokens": 1, "completion_tokens": len(texts), "total_tokens": 1}
        yield chunk({"choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"
    finally:
        if ended is not None:
            ended.append(name)


async def stuck(ended: list[str], name: str) -> AsyncIterator[bytes]:
    """A stream whose head came and whose first token never does, until the gateway closes it."""
    try:
        await asyncio.Event().wait()
        yield b""
    finally:
        ended.append(name)


def streams(*texts: str, cut: bool = False, hold: asyncio.Event | None = None) -> Answer:
    async def answer(request: MockRequest) -> MockResponse:
        return MockResponse.sse(words(*texts, cut=cut, hold=hold))

    return answer


def status(code: int, message: str = "no") -> Answer:
    async def answer(request: MockRequest) -> MockResponse:
        return MockResponse.json({"error": {"message": message}}, code)

    return answer


async def refuses_connections(request: MockRequest) -> MockResponse:
    raise ConnectionRefusedError("nothing listens")


async def completes(request: MockRequest) -> MockResponse:
    doc = {"choices": [{"index": 0, "message": {"content": request.backend.id}}]}
    return MockResponse.json(doc)


@dataclass
class Rescuing(InOrder):
    """``InOrder`` with the rescue capability: a streamed first attempt with no first token
    within ``within`` s is moved to another backend, or (``hedges``) raced there."""

    within: float = 0.01
    hedges: bool = False
    hedge_budget: float = 1.0

    def first_token_deadline(self, backend: str, ttft: float) -> float:
        return self.within


@dataclass
class Run:
    gw: RunningGateway
    transport: MockTransport

    def asked(self, path: str = "/v1/chat/completions") -> list[str]:
        """The backends sent a request on ``path``, in order."""
        return [r.backend.id for r in self.transport.requests if r.path == path]

    def bodies(self, path: str = "/v1/chat/completions") -> list[dict[str, Any]]:
        return [r.json() for r in self.transport.requests if r.path == path]

    async def no_leaks(self) -> None:
        """Every lease released: the pool's snapshots show nothing in flight."""
        pool = self.gw.svc.router.pool

        def idle() -> bool:
            return all(pool.snapshot(b, 0.0).in_flight == 0 for b in pool.all())

        await wait_for(idle, what="every lease released")


@asynccontextmanager
async def gateway(
    fleet: Fleet, policy: InOrder | None = None, **settings: Any
) -> AsyncIterator[Run]:
    transport = MockTransport(fleet)
    async with running_gateway(BACKENDS, transport=transport, **settings) as gw:
        gw.svc.router.policy = policy or InOrder()
        yield Run(gw, transport)


async def post(run: Run, body: dict[str, Any]) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.gw.url + "/v1/chat/completions", json=body) as r,
    ):
        return r.status, await r.read()


def text_of(raw: bytes) -> str:
    out = []
    for e in events(raw):
        if isinstance(e, dict):
            for c in e.get("choices", []):
                out.append((c.get("delta") or {}).get("content") or "")
    return "".join(out)


@pytest.fixture
def lag_tolerated(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rescue is declined when the event loop ran its deadline late (a saturated gateway);
    a busy test machine must not make that choice for the test."""
    monkeypatch.setattr(call, "RESCUE_MAX_LAG_S", float("inf"))


async def test_a_retryable_status_before_the_first_byte_is_retried_on_the_next_backend() -> None:
    fleet = Fleet({"a": status(503, "full"), "b": streams("b0", "b1"), "c": streams("c0")})
    async with gateway(fleet, retry=NO_BACKOFF) as run:
        code, raw = await post(run, CHAT)
        assert code == 200
        assert text_of(raw) == "b0b1"  # b's answer, nothing of a's refusal
        assert run.asked() == ["a", "b"]
        first, second = run.bodies()
        assert first == second == CHAT | {"stream_options": {"include_usage": True}}
        assert sample(run.gw, "llm_gateway_retries_total", backend="a", reason="BackendRefused")
        await run.no_leaks()


async def test_a_connect_error_fails_over_to_another_backend() -> None:
    fleet = Fleet({"a": refuses_connections, "b": completes, "c": completes})
    async with gateway(fleet, retry=NO_BACKOFF) as run:
        code, raw = await post(run, PLAIN)
        assert code == 200
        assert json.loads(raw)["choices"][0]["message"]["content"] == "b"
        assert run.asked() == ["a", "b"]
        assert run.bodies()[0] == run.bodies()[1]
        await run.no_leaks()


async def test_a_stream_cut_after_its_first_byte_is_not_retried() -> None:
    fleet = Fleet({"a": streams("a0", "a1", cut=True), "b": streams("b0"), "c": streams("c0")})
    async with gateway(fleet, retry=NO_BACKOFF, continuation={"enabled": False}) as run:
        code, raw = await post(run, CHAT)
        assert code == 200  # the head had gone out with the first byte
        assert text_of(raw) == "a0a1"
        assert any(isinstance(e, dict) and "error" in e for e in events(raw))
        assert run.asked() == ["a"]  # the client had bytes: no other backend is asked
        await run.no_leaks()


async def test_a_client_error_is_answered_as_is_and_not_retried() -> None:
    fleet = Fleet({"a": status(400, "bad max_tokens"), "b": completes, "c": completes})
    async with gateway(fleet, retry=NO_BACKOFF) as run:
        code, raw = await post(run, PLAIN)
        assert code == 400
        assert json.loads(raw)["error"]["message"] == "bad max_tokens"
        assert run.asked() == ["a"]  # another backend would refuse it the same way
        await run.no_leaks()


async def test_attempts_stop_at_max_attempts_and_the_last_refusal_is_the_answer() -> None:
    fleet = Fleet({"a": status(503, "a full"), "b": status(429, "b busy"), "c": completes})
    async with gateway(fleet, retry=NO_BACKOFF | {"max_attempts": 2}) as run:
        code, raw = await post(run, PLAIN)
        assert code == 429
        assert json.loads(raw)["error"]["message"] == "b busy"
        assert run.asked() == ["a", "b"]  # c would have answered, but the bound is 2
        await run.no_leaks()


async def test_no_attempt_follows_once_the_retry_deadline_has_passed() -> None:
    """The deadline counts from the request's arrival; one of a microsecond has passed by the
    time the first attempt is judged, so its refusal is the answer."""
    fleet = Fleet({"a": status(503, "a full"), "b": completes, "c": completes})
    async with gateway(fleet, retry=NO_BACKOFF | {"deadline": 1e-6}) as run:
        code, raw = await post(run, PLAIN)
        assert code == 503
        assert json.loads(raw)["error"]["message"] == "a full"
        assert run.asked() == ["a"]
        await run.no_leaks()


async def test_a_stream_with_no_first_token_by_its_deadline_is_moved_to_another_backend(
    lag_tolerated: None,
) -> None:
    ended: list[str] = []

    async def late(request: MockRequest) -> MockResponse:
        return MockResponse.sse(stuck(ended, "a"))

    fleet = Fleet({"a": late, "b": streams("b0", "b1"), "c": streams("c0")})
    async with gateway(fleet, Rescuing(within=0.01), retry=NO_BACKOFF) as run:
        code, raw = await post(run, CHAT)
        assert code == 200
        assert text_of(raw) == "b0b1"
        assert run.asked() == ["a", "b"]
        assert run.bodies()[0] == run.bodies()[1]
        assert ended == ["a"]  # the late request was closed on its backend
        rescued = sample(run.gw, "llm_gateway_retries_total", backend="a", reason="FirstTokenLate")
        assert rescued == 1
        assert sample(run.gw, "llm_gateway_hedges_total", won="hedge") == 0  # moved, not raced
        await run.no_leaks()


async def test_a_late_stream_is_hedged_and_the_loser_is_cancelled(lag_tolerated: None) -> None:
    ended: list[str] = []

    async def late(request: MockRequest) -> MockResponse:
        return MockResponse.sse(stuck(ended, "a"))

    fleet = Fleet({"a": late, "b": streams("b0", "b1"), "c": streams("c0")})
    async with gateway(fleet, Rescuing(within=0.01, hedges=True), retry=NO_BACKOFF) as run:
        code, raw = await post(run, CHAT)
        assert code == 200
        assert text_of(raw) == "b0b1"  # one answer, the hedge's
        assert run.asked() == ["a", "b"]
        assert run.bodies()[0] == run.bodies()[1]  # the hedge is a copy of the request
        await wait_for(lambda: ended == ["a"], what="the first request cancelled")
        finished = [(r.backend.id, whole) for r, whole in run.transport.finished]
        assert sorted(finished) == [("a", False), ("b", True)]
        assert sample(run.gw, "llm_gateway_hedges_total", won="hedge") == 1
        rescued = sample(run.gw, "llm_gateway_retries_total", backend="a", reason="FirstTokenLate")
        assert rescued == 0  # raced, not moved
        await run.no_leaks()


async def test_a_broken_stream_continues_on_another_backend_from_what_was_sent() -> None:
    async def tokenize(request: MockRequest) -> MockResponse:
        assert request.json()["prompt"] == "a0a1a2"
        return MockResponse.json({"count": 3})

    async def rest(request: MockRequest) -> MockResponse:
        if request.path == "/tokenize":
            return await tokenize(request)
        return MockResponse.sse(words("b3", "b4"))

    fleet = Fleet({"a": streams("a0", "a1", "a2", cut=True), "b": rest, "c": rest})
    async with gateway(fleet, retry=NO_BACKOFF) as run:
        code, raw = await post(run, CHAT)
        assert code == 200
        assert text_of(raw) == "a0a1a2b3b4"  # nothing missing, nothing repeated
        assert not any(isinstance(e, dict) and "error" in e for e in events(raw))
        assert run.asked() == ["a", "b"]
        assert run.asked("/tokenize") == ["b"]
        resumed = run.bodies()[1]
        sent = {"role": "assistant", "content": "a0a1a2"}
        assert resumed["messages"] == [*CHAT["messages"], sent]
        assert resumed["continue_final_message"] is True
        assert resumed["max_tokens"] == CHAT["max_tokens"] - 3
        await run.no_leaks()


async def test_each_attempt_is_told_to_the_policy_as_it_really_ended() -> None:
    """A refusal, an unreachable backend, then a stream: three outcomes, in order."""
    fleet = Fleet(
        {"a": status(503, "full"), "b": refuses_connections, "c": streams("t0", "t1", "t2", "t3")}
    )
    policy = InOrder()
    async with gateway(fleet, policy, retry=NO_BACKOFF) as run:
        code, raw = await post(run, CHAT)
    assert code == 200
    assert raw.endswith(b"data: [DONE]\n\n")
    assert b"usage" not in raw  # asked for upstream, not by this client
    (a, first), (b, second), (c, third) = policy.outcomes
    assert (a, first.ok, first.status, first.error) == ("a", False, 503, "refused")
    assert (b, second.ok, second.status, second.error) == ("b", False, 0, "unreachable")
    assert (c, third.ok, third.status, third.error) == ("c", True, 200, None)
    assert third.first_token_s is not None
    assert third.first_token_s >= 0
    assert third.tokens == 4
    assert [req.backend.id for req in run.transport.requests] == ["a", "b", "c"]
    assert [(req.backend.id, complete) for req, complete in run.transport.finished] == [
        ("a", True),  # its refusal was read whole: the connection can be reused
        ("c", True),
    ]  # b never answered, so there was nothing to finish


async def test_a_cut_stream_and_a_client_that_leaves_are_told_apart() -> None:
    hold = asyncio.Event()
    held = streams("t0", "t1", "t2", hold=hold)
    fleet = Fleet({"a": streams("t0", "t1", "t2", cut=True), "b": held, "c": held})
    policy = InOrder()
    # Not continued elsewhere (tests/gateway/request/test_continuation.py covers that): one
    # outcome each.
    async with gateway(fleet, policy, continuation={"enabled": False}) as run:
        _, raw = await post(run, CHAT)
        assert b'"error"' in raw  # the stream began, so it ends with an error event
        fleet.answers["a"] = held
        async with aiohttp.ClientSession() as s:
            r = await s.post(run.gw.url + "/v1/chat/completions", json=CHAT)
            await r.content.readuntil(b"t0")
            r.close()  # the client leaves mid-stream
            await wait_for(lambda: len(policy.outcomes) == 2, what="the second outcome")
    (_, broken), (_, left) = policy.outcomes
    assert (broken.ok, broken.error) == (False, "stream")
    assert broken.first_token_s is not None
    assert (left.ok, left.error) == (False, "abandoned")
    assert [complete for _, complete in run.transport.finished] == [False, False]  # both closed


async def test_prefix_affinity_learns_only_what_the_backend_really_took() -> None:
    """A prefix is recorded tentatively at the choice; the failed attempt's record is
    withdrawn, the successful one's kept (issue 17: it was recorded before the attempt)."""
    fleet = Fleet({"a": status(503, "full"), "b": streams("t0", "t1")})
    async with running_gateway(
        BACKENDS[:2], transport=MockTransport(fleet), policy="prefix_affinity"
    ) as gw:
        policy = gw.svc.router.policy
        assert isinstance(policy, PrefixAffinity)
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(gw.url + "/v1/chat/completions", json=LONG) as r:
                    assert r.status == 200
                    await r.read()
        facts = gw.svc.router.route("m", LONG, {}).serve.facts
        held = policy.index.match(facts.prefix_hashes, ["a", "b"])
    assert held["a"] == 0  # a refused every time it was tried: it holds nothing
    assert held["b"] == len(facts.prefix_hashes) > 0
    assert policy.index.footprint("a") == 0


async def test_a_model_pool_and_prefill_then_decode_run_the_same_loop() -> None:
    """Disaggregated serving without any server: the prefill refuses once, moves on, and the
    decode streams; every backend's request is closed or completed."""

    async def prefill(request: MockRequest) -> MockResponse:
        doc = request.json()
        assert doc["max_tokens"] == 1
        assert doc["stream"] is False
        kv = {"remote_engine_id": request.backend.id, "remote_block_ids": [1, 2]}
        return MockResponse.json({"choices": [], "kv_transfer_params": kv})

    async def busy(request: MockRequest) -> MockResponse:
        return MockResponse.json({"error": {"message": "full"}}, 503, **{"Retry-After": "2"})

    async def decode(request: MockRequest) -> MockResponse:
        assert request.json()["kv_transfer_params"]["remote_engine_id"] == "p1"
        return MockResponse.sse(words("t0", "t1", "t2"))

    backends = [
        {"url": "http://p0.invalid:1", "name": "p0", "role": "prefill"},
        {"url": "http://p1.invalid:1", "name": "p1", "role": "prefill"},
        {"url": "http://d0.invalid:1", "name": "d0", "role": "decode"},
    ]
    fleet = Fleet({"p0": busy, "p1": prefill, "d0": decode})
    transport = MockTransport(fleet)
    async with (
        running_gateway(
            backends, transport=transport, disagg={"prefill": {"policy": "round_robin"}}
        ) as gw,
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/chat/completions", json=CHAT) as r,
    ):
        assert r.status == 200
        body = await r.read()
    assert body.count(b'"content": "t') == 3
    assert [req.backend.id for req in transport.requests] == ["p0", "p1", "d0"]
    assert [complete for _, complete in transport.finished] == [True, True, True]
