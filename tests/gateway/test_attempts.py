"""The attempt loop and the policy contract, with backends in memory (``MockTransport``).

No backend server runs here: each backend is a function, so what the loop does on each kind
of answer (refusal, connection refused, a cut stream, a client that leaves) and what the
policy is told about it can be pinned exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp

from backends.upstream.mock import MockRequest, MockResponse, MockTransport
from policies import PrefixAffinity
from tests.helpers import running_gateway, wait_for
from tests.mock_fleet import Fleet, InOrder, chunk

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi " * 40}], "stream": True}


async def tokens(
    n: int, *, hold: asyncio.Event | None = None, cut: bool = False
) -> AsyncIterator[bytes]:
    yield chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    for i in range(n):
        if hold is not None and i == 1:
            await hold.wait()
        yield chunk({"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]})
    if cut:
        raise ConnectionResetError("the backend died")
    usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
    yield chunk({"choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


BACKENDS = [{"url": f"http://{n}.invalid:8000", "name": n} for n in ("a", "b", "c")]


async def test_each_attempt_is_told_to_the_policy_as_it_really_ended() -> None:
    """A refusal, an unreachable backend, then a stream: three outcomes, in order."""

    async def refused(request: MockRequest) -> MockResponse:
        return MockResponse.json({"error": {"message": "full"}}, 503)

    async def unreachable(request: MockRequest) -> MockResponse:
        raise ConnectionRefusedError("nothing listens")

    async def streams(request: MockRequest) -> MockResponse:
        return MockResponse.sse(tokens(4))

    fleet = Fleet({"a": refused, "b": unreachable, "c": streams})
    transport = MockTransport(fleet)
    policy = InOrder()
    async with running_gateway(BACKENDS, transport=transport, retry={"backoff_base": 0}) as gw:
        gw.svc.router.policy = policy
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw.url + "/v1/chat/completions", json=CHAT) as r,
        ):
            assert r.status == 200
            body = await r.read()
    assert body.endswith(b"data: [DONE]\n\n")
    assert b"usage" not in body  # asked for upstream, not by this client
    (a, first), (b, second), (c, third) = policy.outcomes
    assert (a, first.ok, first.status, first.error) == ("a", False, 503, "refused")
    assert (b, second.ok, second.status, second.error) == ("b", False, 0, "unreachable")
    assert (c, third.ok, third.status, third.error) == ("c", True, 200, None)
    assert third.first_token_s is not None
    assert third.first_token_s >= 0
    assert third.tokens == 4
    assert [req.backend.id for req in transport.requests] == ["a", "b", "c"]
    assert [(req.backend.id, complete) for req, complete in transport.finished] == [
        ("a", True),  # its refusal was read whole: the connection can be reused
        ("c", True),
    ]  # b never answered, so there was nothing to finish


async def test_a_cut_stream_and_a_client_that_leaves_are_told_apart() -> None:
    hold = asyncio.Event()

    async def cut(request: MockRequest) -> MockResponse:
        return MockResponse.sse(tokens(3, cut=True))

    async def held(request: MockRequest) -> MockResponse:
        return MockResponse.sse(tokens(3, hold=hold))

    fleet = Fleet({"a": cut, "b": held, "c": held})
    transport = MockTransport(fleet)
    policy = InOrder()
    # Not continued elsewhere (tests/gateway/test_continuation.py covers that): one outcome each.
    off = {"enabled": False}
    async with running_gateway(BACKENDS, transport=transport, continuation=off) as gw:
        gw.svc.router.policy = policy
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
                body = await r.read()
            assert b'"error"' in body  # the stream began, so it ends with an error event
            fleet.answers["a"] = held
            r = await s.post(gw.url + "/v1/chat/completions", json=CHAT)
            await r.content.readuntil(b"t0")
            r.close()  # the client leaves mid-stream
            await wait_for(lambda: len(policy.outcomes) == 2, what="the second outcome")
    (_, broken), (_, left) = policy.outcomes
    assert (broken.ok, broken.error) == (False, "stream")
    assert broken.first_token_s is not None
    assert (left.ok, left.error) == (False, "abandoned")
    assert [complete for _, complete in transport.finished] == [False, False]  # both closed


async def test_prefix_affinity_learns_only_what_the_backend_really_took() -> None:
    """A prefix is recorded tentatively at the choice; the failed attempt's record is
    withdrawn, the successful one's kept (issue 17: it was recorded before the attempt)."""

    async def refused(request: MockRequest) -> MockResponse:
        return MockResponse.json({"error": {"message": "full"}}, 503)

    async def streams(request: MockRequest) -> MockResponse:
        return MockResponse.sse(tokens(2))

    fleet = Fleet({"a": refused, "b": streams, "c": streams})
    async with running_gateway(
        BACKENDS[:2], transport=MockTransport(fleet), policy="prefix_affinity"
    ) as gw:
        policy = gw.svc.router.policy
        assert isinstance(policy, PrefixAffinity)
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 200
                    await r.read()
        facts = gw.svc.router.route("m", CHAT, {}).serve.facts
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
        return MockResponse.sse(tokens(3))

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
