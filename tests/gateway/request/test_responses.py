"""The Responses API through the gateway: a stored response lives on the backend that made
it, and whatever builds on it (``GET``, ``cancel``, ``previous_response_id``) is sent there,
by this replica or another one sharing Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.request.responses import with_response_id
from tests.helpers import RunningGateway, running_gateway
from tools.sim import SimConfig
from tools.sim.http import STATE
from tools.sim.testing import RunningSim, running_sim

FAST = SimConfig(step_base_ms=1.0)
MODEL = "sim-model"


@asynccontextmanager
async def fleet(
    n: int = 3, **overrides: Any
) -> AsyncIterator[tuple[RunningGateway, list[RunningSim]]]:
    async with running_sim(FAST) as a, running_sim(FAST) as b, running_sim(FAST) as c:
        sims = [a, b, c][:n]
        async with running_gateway([s.url for s in sims], policy="round_robin", **overrides) as gw:
            yield gw, sims


def holders(sims: list[RunningSim], response_id: str) -> list[str]:
    """The backend ids (host:port) of the simulators that store ``response_id``."""
    return [s.url[7:] for s in sims if response_id in s.app[STATE].responses.items]


def sdk(gw: RunningGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=30)


async def backend_counts(gw: RunningGateway) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for f in text_string_to_metric_families(text):
        for smp in f.samples:
            if smp.name == "llm_gateway_requests_total" and smp.labels["endpoint"] == "responses":
                out[smp.labels["backend"]] = out.get(smp.labels["backend"], 0) + smp.value
    return out


async def test_stored_responses_are_fetched_and_continued_on_the_backend_that_made_them() -> None:
    async with fleet() as (gw, sims), sdk(gw) as client:
        for _ in range(4):  # round robin would send a follow-up elsewhere two times in three
            first = await client.responses.create(model=MODEL, input="hello", max_output_tokens=5)
            assert first.id.startswith("resp_")
            assert first.usage is not None
            assert first.usage.output_tokens == 5
            again = await client.responses.retrieve(first.id)
            assert again.id == first.id
            assert again.output_text == first.output_text
            follow = await client.responses.create(
                model=MODEL, input="and then?", previous_response_id=first.id, max_output_tokens=3
            )
            assert follow.previous_response_id == first.id
            fetched = await client.responses.retrieve(follow.id)
            assert fetched.id == follow.id
            # Stored once, where the gateway sent it; the follow-up went to the same backend.
            assert len(holders(sims, first.id)) == 1
            assert holders(sims, follow.id) == holders(sims, first.id)
        counts = await backend_counts(gw)
        assert sum(counts.values()) == 4 * 4  # create, retrieve, follow-up, retrieve


async def test_a_streamed_response_is_relayed_as_named_events_and_stored() -> None:
    async with fleet() as (gw, _sims), sdk(gw) as client:
        stream = await client.responses.create(
            model=MODEL, input="stream me", max_output_tokens=4, stream=True
        )
        kinds, rid, text = [], None, ""
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.created":
                rid = event.response.id
            elif event.type == "response.output_text.delta":
                text += event.delta
        assert kinds[0] == "response.created"
        assert kinds[-1] == "response.completed"
        assert kinds.count("response.output_text.delta") == 4
        assert rid is not None
        for _ in range(3):
            assert (await client.responses.retrieve(rid)).output_text == text


async def test_unknown_lost_and_unstored_responses_are_openai_errors() -> None:
    async with fleet(2) as (gw, sims), sdk(gw) as client:
        with pytest.raises(openai.NotFoundError) as nf:
            await client.responses.retrieve("resp_nobody")
        assert nf.value.body["code"] == "response_not_found"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError) as nf:
            await client.responses.create(
                model=MODEL, input="x", previous_response_id="resp_nobody", max_output_tokens=2
            )
        assert nf.value.body["param"] == "previous_response_id"  # type: ignore[index]
        unstored = await client.responses.create(
            model=MODEL, input="x", store=False, max_output_tokens=2
        )
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        kept = await client.responses.create(model=MODEL, input="x", max_output_tokens=2)
        # Its backend leaves the fleet: the response is lost, and the gateway says so.
        [home] = holders(sims, kept.id)
        gw.svc.pool.remove(home)
        with pytest.raises(openai.NotFoundError) as nf:
            await client.responses.retrieve(kept.id)
        assert nf.value.body["code"] == "response_backend_gone"  # type: ignore[index]
        # Cancelling a finished (synchronous) response: the backend's own answer.
        done = await client.responses.create(model=MODEL, input="y", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError):
            await client.responses.cancel(done.id)


async def test_replicas_sharing_redis_find_each_others_responses(
    redis_url: str, redis_prefix: str
) -> None:
    shared = {
        "responses": {"store": "redis"},
        "limits": {"redis": {"url": redis_url, "key_prefix": redis_prefix + "limits:"}},
    }
    async with running_sim(FAST) as a, running_sim(FAST) as b:
        urls = [a.url, b.url]
        async with (
            running_gateway(urls, policy="round_robin", **shared) as one,
            running_gateway(urls, policy="round_robin", **shared) as two,
            sdk(one) as c1,
            sdk(two) as c2,
        ):
            for _ in range(3):
                made = await c1.responses.create(model=MODEL, input="hi", max_output_tokens=2)
                assert (await c2.responses.retrieve(made.id)).id == made.id
                follow = await c2.responses.create(
                    model=MODEL, input="more", previous_response_id=made.id, max_output_tokens=2
                )
                assert (await c1.responses.retrieve(follow.id)).id == follow.id


def test_the_gateway_names_each_response_unless_the_client_did() -> None:
    rid, doc, raw = with_response_id({"model": "m", "input": "x"}, b'{"model":"m","input":"x"} ')
    assert rid.startswith("resp_")
    assert doc["request_id"] == rid
    assert raw == b'{"model":"m","input":"x","request_id":"' + rid.encode() + b'"}'
    rid, doc, raw = with_response_id({"request_id": "mine"}, b'{"request_id":"mine"}')
    assert (rid, raw) == ("mine", b'{"request_id":"mine"}')
