"""A request's priority reaches the engines that schedule by it, and only those; a client's own
priority stands only where its tier lets it set it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from backends.upstream.mock import MockRequest, MockResponse, MockTransport
from gateway.limits.keys import Principal
from gateway.limits.memory import Limits
from gateway.request.priority import VLLM_PRIORITY, engine_priority
from policies import BackendSnapshot, Decision, RouteFacts
from tests.helpers import running_gateway
from tests.mock_fleet import Fleet, InOrder, chunk


def principal(*, own: bool = False) -> Principal:
    return Principal("key:k", "t", Limits(), 10, True, own_engine_priority=own)


@pytest.mark.parametrize(
    ("doc", "headers", "own", "priority", "sent"),
    [
        ({}, {}, False, 0, None),  # nothing to say
        ({}, {}, False, 5, -5),  # higher first at the gateway, lower first in vLLM
        ({}, {}, False, -20, 20),  # batch-class
        ({"priority": -9}, {}, False, 3, -3),  # the client's own, replaced
        ({"priority": -9}, {}, False, 0, 0),  # ... even by the default
        ({}, {VLLM_PRIORITY: "-9"}, False, 0, 0),
        ({"priority": -9}, {}, True, 3, None),  # its tier lets it: its own stands
        ({}, {}, True, 3, -3),  # it set none: the gateway's
    ],
)
def test_the_priority_sent_to_the_engines(
    doc: dict[str, Any], headers: dict[str, str], own: bool, priority: int, sent: int | None
) -> None:
    assert engine_priority(doc, headers, principal(own=own), priority) == sent


@dataclass
class Named(InOrder):
    """Picks the backend named in ``first``."""

    first: str = "a"

    def choose(self, facts: RouteFacts, candidates: list[BackendSnapshot]) -> Decision | None:
        return next((Decision(c) for c in candidates if c.id == self.first), None)


async def ok(_request: MockRequest) -> MockResponse:
    async def body():  # type: ignore[no-untyped-def]
        yield chunk({"choices": [{"index": 0, "delta": {"content": "ok"}}]})
        yield b"data: [DONE]\n\n"

    return MockResponse.sse(body())


async def sent_priorities(headers: dict[str, str], *, own: bool = False) -> dict[str, str | None]:
    """What each backend got in X-Vllm-Priority for one request each (``a`` schedules by
    priority, ``b`` first come first served)."""
    backends = [
        {"url": "http://a.invalid:8000", "name": "a", "scheduling": "priority"},
        {"url": "http://b.invalid:8000", "name": "b"},
    ]
    tiers = {"default": {"max_priority": 10, "priority": 2, "own_engine_priority": own}}
    transport = MockTransport(Fleet({"a": ok, "b": ok}))
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with running_gateway(backends, transport=transport, limits={"tiers": tiers}) as gw:
        policy = Named()
        gw.svc.router.policy = policy
        async with aiohttp.ClientSession() as s:
            for first in ("a", "b"):
                policy.first = first
                async with s.post(gw.url + "/v1/chat/completions", json=chat, headers=headers) as r:
                    assert r.status == 200
                    await r.read()
    return {q.backend.id: q.headers.get(VLLM_PRIORITY) for q in transport.requests}


async def test_only_engines_that_schedule_by_priority_get_it() -> None:
    assert await sent_priorities({"x-priority": "7"}) == {"a": "-7", "b": None}


async def test_the_tiers_own_priority_when_the_request_asks_none() -> None:
    assert await sent_priorities({}) == {"a": "-2", "b": None}


async def test_a_clients_own_engine_priority_stands_only_if_its_tier_allows() -> None:
    assert await sent_priorities({VLLM_PRIORITY: "-50"}) == {"a": "-2", "b": None}
    assert await sent_priorities({VLLM_PRIORITY: "-50"}, own=True) == {"a": "-50", "b": "-50"}


async def test_where_vllm_reads_only_the_body_the_gateway_sets_the_field() -> None:
    async def embeds(_request: MockRequest) -> MockResponse:
        return MockResponse.json({"object": "list", "data": [], "model": "m"})

    backends = [
        {"url": "http://a.invalid:8000", "name": "a", "scheduling": "priority"},
        {"url": "http://b.invalid:8000", "name": "b"},
    ]
    tiers = {"default": {"max_priority": 10}}
    transport = MockTransport(Fleet({"a": embeds, "b": embeds}))
    body = {"model": "m", "input": "hi", "priority": -40}  # its own, not allowed
    async with running_gateway(backends, transport=transport, limits={"tiers": tiers}) as gw:
        policy = Named()
        gw.svc.router.policy = policy
        async with aiohttp.ClientSession() as s:
            for first in ("a", "b"):
                policy.first = first
                headers = {"x-priority": "4"}
                async with s.post(gw.url + "/v1/embeddings", json=body, headers=headers) as r:
                    assert r.status == 200
    sent = {q.backend.id: q.json().get("priority") for q in transport.requests}
    assert sent == {"a": -4, "b": -40}  # b schedules first come first served: left as sent
