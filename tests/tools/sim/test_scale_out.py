"""vLLM 0.32's scale-out endpoints on the simulator: 403 unless enabled; render gives the
prompt's ids and sampling parameters, which generate runs on the engine like the request
they came from (the same ids out), streamed or not, aborted by id or by a disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.tokenizer.words import tokenize
from tests.waiting import wait_for
from tools.sim import FAST, Faults, RunningSim, running_sim
from tools.sim.scale_out import ROUTES
from tools.sim.tokens import EOS_TOKEN_ID

from .conftest import assert_clean, completion_body, sse_events

SCALE_OUT = FAST.replace(enable_scale_out=True)


@pytest.fixture
async def sim() -> AsyncIterator[RunningSim]:
    async with running_sim(SCALE_OUT) as s:
        yield s


async def json_post(client: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with client.post(url, json=body) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("path", ROUTES)
async def test_every_scale_out_route_is_403_unless_enabled(
    client: aiohttp.ClientSession, path: str
) -> None:
    async with running_sim(FAST) as sim:
        status, body = await json_post(client, f"{sim.url}{path}", {"token_ids": [1]})
    assert status == 403
    assert body == {
        "error": {
            "message": "Scale-out endpoints are disabled. Restart vllm serve with "
            "--enable-scale-out to enable them.",
            "type": "PermissionDeniedError",
            "param": None,
            "code": 403,
        }
    }


async def test_generate_gives_the_ids_of_the_equivalent_completion(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = completion_body("the same prompt every time", max_tokens=8, seed=7)
    _, completion = await json_post(client, f"{sim.url}/v1/completions", body)
    status, rendered = await json_post(client, f"{sim.url}/v1/completions/render", body)
    assert status == 200
    [request] = rendered
    assert request["request_id"].startswith("cmpl-")
    assert request["token_ids"] == tokenize("the same prompt every time")
    assert request["sampling_params"] == {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "min_p": 0.0,
        "seed": 7,
        "stop": [],
        "stop_token_ids": [],
        "max_tokens": 8,
        "output_kind": 2,
        "skip_clone": True,
        "bad_words": [],
        "skip_reading_prefix_cache": False,
    }
    assert (request["stream"], request["stream_options"], request["output_mode"]) == (
        False,
        None,
        "tokens",
    )

    status, generated = await json_post(client, f"{sim.url}/inference/v1/generate", request)
    assert status == 200
    assert generated["request_id"] == "generate-tokens-" + request["request_id"]
    assert generated["model"] == "sim-model"
    [choice] = generated["choices"]
    assert choice["token_ids"] == tokenize(completion["choices"][0]["text"])
    assert choice["finish_reason"] == completion["choices"][0]["finish_reason"] == "length"
    assert generated["usage"] == {**completion["usage"], "completion_tokens_details": None}
    assert set(choice) == {
        "index",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "routed_experts",
        "sampling_mask",
        "weight_versions",
        "logprobs",
    }

    status, text = await json_post(
        client, f"{sim.url}/inference/v1/generate", {**request, "output_mode": "text"}
    )
    assert text["choices"][0]["text"] == completion["choices"][0]["text"]


async def test_a_rendered_message_generates_the_messages_answer(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = {
        "model": "sim-model",
        "max_tokens": 300,
        "system": "be brief",
        "messages": [{"role": "user", "content": "hello there"}],
        "stream": True,
        "temperature": 0.5,
    }
    _, request = await json_post(client, f"{sim.url}/v1/messages/render", body)
    assert request["request_id"].startswith("chatcmpl-")
    assert request["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert request["sampling_params"]["output_kind"] == 1  # a stream: deltas
    assert request["sampling_params"]["temperature"] == 0.5
    _, counted = await json_post(
        client,
        f"{sim.url}/v1/messages/count_tokens",
        {k: body[k] for k in ("model", "system", "messages")},
    )
    assert len(request["token_ids"]) == counted["input_tokens"]

    _, message = await json_post(client, f"{sim.url}/v1/messages", {**body, "stream": False})
    _, generated = await json_post(
        client, f"{sim.url}/inference/v1/generate", {**request, "stream": False}
    )
    ids = generated["choices"][0]["token_ids"]
    assert ids[-1] == EOS_TOKEN_ID  # the EOS token is generated, and counted
    assert ids[:-1] == tokenize(message["content"][0]["text"])
    assert generated["usage"]["completion_tokens"] == message["usage"]["output_tokens"]


async def test_generate_streams_a_chunk_per_token(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = {
        "token_ids": [5, 6, 7],
        "sampling_params": {"max_tokens": 4},
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "return_token_ids": True,
        "request_id": "mine",
    }
    async with client.post(f"{sim.url}/inference/v1/generate", json=body) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        *chunks, usage, done = sse_events(await resp.read())
    assert done == "[DONE]"
    assert len(chunks) == 4
    assert all(c["request_id"] == "generate-tokens-mine" for c in chunks)
    assert chunks[0]["prompt_token_ids"] == [5, 6, 7]  # the first chunk only
    assert "prompt_token_ids" not in chunks[1]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4]
    assert all(len(c["choices"][0]["token_ids"]) == 1 for c in chunks)
    assert usage == {
        "request_id": "generate-tokens-mine",
        "usage": {"prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4},
        "output_mode": "tokens",
        "choices": [],
    }


async def test_abort_requests_ends_a_generate_stream_with_abort(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = {
        "token_ids": [1, 2],
        "sampling_params": {"max_tokens": 4000, "ignore_eos": True},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"X-Request-Id": "job-1"}
    async with client.post(f"{sim.url}/inference/v1/generate", json=body, headers=headers) as resp:
        for _ in range(3):
            await resp.content.readuntil(b"\n\n")  # decoding
        async with client.post(
            f"{sim.url}/inference/v1/abort_requests",
            json={"request_ids": ["generate-tokens-job-1", "unknown"]},
        ) as aborted:
            assert aborted.status == 200
            assert await aborted.read() == b""
        rest = await resp.read()
    *_, last, usage, done = sse_events(rest)
    assert done == "[DONE]"
    assert last["choices"][0]["finish_reason"] == "abort"
    assert last["choices"][0]["token_ids"] == []
    assert 3 <= usage["usage"]["completion_tokens"] < 4000
    assert sim.engine.stats.aborted["decode"] == 1
    await wait_for(lambda: sim.state.in_flight == 0, within=10, what="handler done")
    assert_clean(sim)
    assert not sim.state.generate_requests


async def test_abort_requests_ends_a_waiting_generate_request(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = {"token_ids": [1], "sampling_params": {"max_tokens": 4000, "ignore_eos": True}}
    waiting = asyncio.create_task(
        client.post(f"{sim.url}/inference/v1/generate", json={**body, "request_id": "r"})
    )
    await wait_for(lambda: sim.engine.stats.generation_tokens > 3, within=10, what="decoding")
    status = (
        await client.post(
            f"{sim.url}/inference/v1/abort_requests", json={"request_ids": "generate-tokens-r"}
        )
    ).status
    assert status == 200
    async with await waiting as resp:
        done = await resp.json()
    [choice] = done["choices"]
    assert choice["finish_reason"] == "abort"
    assert len(choice["token_ids"]) == done["usage"]["completion_tokens"] > 3
    assert sum(sim.engine.stats.request_success.values()) == 0


async def test_a_client_gone_aborts_its_generate_request(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = {
        "token_ids": [1, 2],
        "sampling_params": {"max_tokens": 4000, "ignore_eos": True},
        "stream": True,
    }
    async with client.post(f"{sim.url}/inference/v1/generate", json=body) as resp:
        await resp.content.readuntil(b"\n\n")
        resp.close()
    await wait_for(lambda: sim.engine.stats.aborted["decode"] == 1, within=10, what="abort")
    assert_clean(sim)


async def test_a_generate_stream_fails_as_chats_do(client: aiohttp.ClientSession) -> None:
    async with running_sim(SCALE_OUT, Faults(error_after_tokens=2)) as sim:
        body = {"token_ids": [1], "sampling_params": {"max_tokens": 10}, "stream": True}
        async with client.post(f"{sim.url}/inference/v1/generate", json=body) as resp:
            *chunks, error, done = sse_events(await resp.read())
    assert len(chunks) == 2
    assert error == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    assert done == "[DONE]"


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        (
            {"token_ids": [], "sampling_params": {}},
            400,
            {
                "message": "1 validation error:\n  {'type': 'too_short', 'loc': 'body.token_ids', "
                "'msg': 'List should have at least 1 item after validation, not 0', 'input': "
                "'<list of 0 items>', 'ctx': {'field_type': 'List', 'min_length': 1, "
                "'actual_length': 0}}",
                "type": "Bad Request",
                "param": "body.token_ids",
                "code": 400,
            },
        ),
        (
            {"token_ids": [1]},
            400,
            {
                "message": "1 validation error:\n  {'type': 'missing', 'loc': "
                "'body.sampling_params', 'msg': 'Field required', 'input': '<dict of 1 items>'}",
                "type": "Bad Request",
                "param": "body.sampling_params",
                "code": 400,
            },
        ),
        (
            {"token_ids": [1], "sampling_params": {"max_tokens": 0}},
            400,
            {
                "message": "max_tokens must be at least 1, got 0.",
                "type": "BadRequestError",
                "param": "max_tokens",
                "code": 400,
            },
        ),
        (
            {"token_ids": [1], "sampling_params": {}, "model": "nope"},
            404,
            {
                "message": "The model `nope` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            },
        ),
    ],
)
async def test_generate_rejects_bodies_as_vllm_does(
    sim: RunningSim,
    client: aiohttp.ClientSession,
    *,
    body: dict[str, Any],
    status: int,
    error: dict[str, Any],
) -> None:
    got_status, got = await json_post(client, f"{sim.url}/inference/v1/generate", body)
    assert got_status == status
    assert got == {"error": error}


async def test_abort_requests_needs_request_ids(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    status, body = await json_post(client, f"{sim.url}/inference/v1/abort_requests", {})
    assert status == 400
    assert body["error"] == {
        "message": "Missing 'request_ids' in request body",
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }


async def test_a_rendered_chat_keeps_its_sampling_parameters(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0,
        "stop": ["abc", "d"],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    _, doc = await json_post(client, f"{sim.url}/v1/chat/completions/render", body)
    assert doc["request_id"].startswith("chatcmpl-")
    assert doc["model"] is None
    assert doc["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert doc["sampling_params"] == {  # greedy: no top_p, top_k, min_p
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 0.0,
        "stop": ["abc", "d"],
        "stop_token_ids": [],
        "max_tokens": FAST.max_model_len - 3,
        "output_kind": 1,
        "skip_clone": True,
        "output_text_buffer_length": 2,
        "bad_words": [],
        "skip_reading_prefix_cache": False,
    }
    assert list(doc) == [  # every field written, as vLLM's GenerateRequest
        "request_id",
        "token_ids",
        "token_offsets",
        "features",
        "content_parts",
        "sampling_params",
        "model",
        "reasoning_ended",
        "reasoning_parser_kwargs",
        "return_token_ids",
        "output_mode",
        "stream",
        "stream_options",
        "cache_salt",
        "priority",
        "kv_transfer_params",
        "ec_transfer_params",
    ]
