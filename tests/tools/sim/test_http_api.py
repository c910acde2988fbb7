"""vLLM 0.32's HTTP surface over real HTTP: endpoints, SSE framing, errors, request ids."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.waiting import wait_for
from tools.sim import FAST, RunningSim, running_sim

from .conftest import chat_body, completion_body, sse_events


async def test_chat_stream_has_role_chunk_content_finish_usage_and_done(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = chat_body(stream=True, max_tokens=5, ignore_eos=True)
    body["stream_options"] = {"include_usage": True}
    async with client.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        events = sse_events(await resp.read())
    first, *tokens, last_token, usage, done = events
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["id"].startswith("chatcmpl-")
    assert len(tokens) == 4
    for chunk in tokens:
        assert chunk["id"] == first["id"]
        assert chunk["choices"][0]["finish_reason"] is None
        assert chunk["choices"][0]["delta"]["content"].startswith(" ")
    assert last_token["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 4, "total_tokens": 9, "completion_tokens": 5}
    assert done == "[DONE]"


async def test_completion_stream_chunks_are_text_completions(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = completion_body(stream=True, max_tokens=3)
    async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
        events = sse_events(await resp.read())
    *chunks, done = events
    assert done == "[DONE]"
    assert len(chunks) == 3  # no role chunk, no usage chunk unless asked
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]


async def test_stream_and_non_stream_give_the_same_text_and_usage(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = completion_body("same prompt every time", max_tokens=8)
    async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
        full = await resp.json()
    async with client.post(
        f"{sim.url}/v1/completions", json={**body, "stream": True, "stream_options": {}}
    ) as resp:
        events = sse_events(await resp.read())
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert full["object"] == "text_completion"
    assert full["choices"][0]["text"] == streamed
    assert full["choices"][0]["finish_reason"] == events[-2]["choices"][0]["finish_reason"]
    assert full["usage"]["prompt_tokens"] == 4
    assert full["usage"]["completion_tokens"] == len(events) - 1


async def test_chat_without_max_tokens_stops_at_its_natural_length(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    async with client.post(f"{sim.url}/v1/chat/completions", json=chat_body()) as resp:
        full = await resp.json()
    choice = full["choices"][0]
    assert full["object"] == "chat.completion"
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant"
    n = full["usage"]["completion_tokens"]
    assert FAST.output_len_min <= n <= FAST.output_len_max
    assert len(choice["message"]["content"].split()) == n - 1  # EOS has no text


async def test_continuous_usage_stats_put_usage_on_every_chunk(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = completion_body(stream=True, max_tokens=3)
    body["stream_options"] = {"continuous_usage_stats": True}
    async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
        events = sse_events(await resp.read())
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [1, 2, 3]


async def test_x_request_id_becomes_the_response_id(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    headers = {"X-Request-Id": "abc-123"}
    async with client.post(
        f"{sim.url}/v1/chat/completions", json=chat_body(max_tokens=2), headers=headers
    ) as resp:
        assert (await resp.json())["id"] == "chatcmpl-abc-123"
        assert "X-Request-Id" not in resp.headers  # vLLM echoes only when asked to
    async with client.post(
        f"{sim.url}/v1/completions", json=completion_body(stream=True), headers=headers
    ) as resp:
        assert sse_events(await resp.read())[0]["id"] == "cmpl-abc-123"


async def test_x_request_id_is_echoed_with_enable_request_id_headers(
    client: aiohttp.ClientSession,
) -> None:
    async with running_sim(FAST.replace(enable_request_id_headers=True)) as sim:
        async with client.post(
            f"{sim.url}/v1/completions", json=completion_body(), headers={"X-Request-Id": "r1"}
        ) as resp:
            assert resp.headers["X-Request-Id"] == "r1"
        async with client.post(f"{sim.url}/v1/completions", json=completion_body()) as resp:
            generated = resp.headers["X-Request-Id"]
            assert (await resp.json())["id"] == f"cmpl-{generated}"


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        (
            "/v1/completions",
            {"prompt": "x", "model": "nope"},
            404,
            "The model `nope` does not exist.",
        ),
        ("/v1/completions", {"prompt": "w " * 5000}, 400, "maximum context length is 4096 tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "is too large: 5000"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream_options": {}},
            400,
            "Stream options can only be defined when `stream=True`.",
        ),
        ("/v1/chat/completions", {"messages": "x"}, 400, "messages"),
        ("/v1/completions", [1, 2], 400, "JSON object"),
    ],
)
async def test_errors_use_vllm_status_and_envelope(
    sim: RunningSim,
    client: aiohttp.ClientSession,
    *,
    path: str,
    body: Any,
    status: int,
    message: str,
) -> None:
    async with client.post(f"{sim.url}{path}", json=body) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"]
    assert error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


async def test_malformed_json_and_wrong_content_type_are_400(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    url = f"{sim.url}/v1/completions"
    async with client.post(url, data=b"{", headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "BadRequestError"
    async with client.post(url, data=b"prompt=x") as r:
        assert r.status == 400


async def test_info_endpoints(sim: RunningSim, client: aiohttp.ClientSession) -> None:
    for path in ("/health", "/ping"):
        async with client.get(f"{sim.url}{path}") as resp:
            assert resp.status == 200
            assert await resp.read() == b""
    async with client.get(f"{sim.url}/version") as resp:
        assert await resp.json() == {"version": "0.32.0"}
    async with client.get(f"{sim.url}/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == FAST.model_name
    assert card["owned_by"] == "vllm"
    assert card["max_model_len"] == FAST.max_model_len
    assert {"created", "root", "parent", "permission"} <= set(card)
    async with client.get(f"{sim.url}/load") as resp:
        assert await resp.json() == {"server_load": 0}
    async with client.get(f"{sim.url}/no/such/path") as resp:
        assert resp.status == 404
        assert await resp.json() == {"detail": "Not Found"}


async def test_served_model_name_is_the_name_clients_use(client: aiohttp.ClientSession) -> None:
    async with running_sim(FAST.replace(model="/models/x", served_model_name="x")) as sim:
        async with client.get(f"{sim.url}/v1/models") as resp:
            card = (await resp.json())["data"][0]
        assert (card["id"], card["root"]) == ("x", "/models/x")
        async with client.post(
            f"{sim.url}/v1/completions", json={"model": "x", "prompt": "a"}
        ) as r:
            assert r.status == 200
        async with client.post(
            f"{sim.url}/v1/completions", json={"model": "/models/x", "prompt": "a"}
        ) as r:
            assert r.status == 404


async def test_load_counts_in_flight_requests_when_tracking(
    client: aiohttp.ClientSession,
) -> None:
    config = FAST.replace(enable_server_load_tracking=True, max_num_seqs=1)
    async with running_sim(config) as sim:
        body = completion_body(stream=True, max_tokens=4000, ignore_eos=True, prompt="a")
        async with (
            client.post(f"{sim.url}/v1/completions", json=body) as first,
            client.post(f"{sim.url}/v1/completions", json=body) as second,
        ):
            async with client.get(f"{sim.url}/load") as resp:
                assert await resp.json() == {"server_load": 2}  # the queued one included
            first.close()
            second.close()


async def test_requests_beyond_max_num_seqs_queue(client: aiohttp.ClientSession) -> None:
    async with running_sim(FAST.replace(max_num_seqs=2)) as sim:
        body = completion_body(stream=True, max_tokens=4000, ignore_eos=True)
        responses = [await client.post(f"{sim.url}/v1/completions", json=body) for _ in range(5)]
        await wait_for(lambda: len(sim.engine.waiting) == 3, within=10, what="3 waiting")
        assert len(sim.engine.running) == 2
        for r in responses:
            r.close()
        await wait_for(lambda: not sim.engine.has_work(), within=10, what="all aborted")
