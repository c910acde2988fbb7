"""vLLM's other endpoints through the gateway, against real servers: a generation server (the
session's first) and a pooling server (``--runner pooling``: the tiny causal LM as an
embedding model) serving the same model name behind one gateway; the Responses API with its
store on, in front of the session's two generation servers; and LoRA adapters (tiny random ones
built here) served by one of two servers, routed only there, loaded and unloaded at run time
through the admin API.

The official ``openai`` client embeds and chats through the same base URL; the gateway sends
each request to a server that has its endpoint, learning which lacks which from vLLM's own
"no such route" answer. Scoring, reranking, tokenizing and detokenizing go through too;
``/classify``, which no server of this model has (no classification head), is a 404 in
OpenAI's shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.servers import (
    SERVED_MODEL,
    START_DEADLINE,
    VllmServer,
    build_lora,
    gateway_for,
    running_vllm_servers,
    vllm_python,
)
from tests.helpers import RunningGateway

HIDDEN_SIZE = 128  # scripts/build_tiny_model.py
# The module starts servers of its own (a pooling one, a LoRA one) inside the first test that
# needs each: that test's time includes the start-up.
pytestmark = pytest.mark.timeout(START_DEADLINE + 120)


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log_dir: Path = tmp_path_factory.mktemp("vllm-pooling")
    # float32, not the bfloat16 of the others: on Intel machines with AMX, vLLM 0.32's CPU
    # build runs bfloat16 attention on AMX tiles, and this server's worker died of SIGILL at
    # its first embedding whenever the continuation tests (servers SIGKILLed and started
    # again) had run before it (never alone); in float32 no AMX kernel is chosen.
    args = ["--runner", "pooling", "--convert", "embed", "--dtype", "float32"]
    with running_vllm_servers(1, log_dir, extra=lambda _: args) as servers:
        yield servers[0]


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One server with LoRA on: the adapter ``tiny-lora`` from the start, room for another."""
    adapters = tmp_path_factory.mktemp("lora")
    static = build_lora(vllm_python(), adapters / "tiny-lora", seed=1)
    build_lora(vllm_python(), adapters / "tiny-lora-2", seed=2)
    args = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    args += ["--lora-modules", f"tiny-lora={static}"]
    with running_vllm_servers(1, adapters, extra=lambda _: args) as servers:
        yield servers[0]


@pytest.fixture
async def mixed(
    servers: list[VllmServer], pooling_server: VllmServer
) -> AsyncIterator[RunningGateway]:
    async with gateway_for([servers[0], pooling_server], policy="round_robin") as gw:
        yield gw


async def test_embeddings_and_chat_share_one_model_name_and_go_where_they_are_served(
    mixed: RunningGateway, servers: list[VllmServer], pooling_server: VllmServer
) -> None:
    async with openai.AsyncOpenAI(
        base_url=f"{mixed.url}/v1", api_key="x", max_retries=0, timeout=60.0
    ) as client:
        for _ in range(3):
            emb = await client.embeddings.create(
                model=SERVED_MODEL, input=["the gateway routes", "every request"]
            )
            assert [d.index for d in emb.data] == [0, 1]
            assert all(len(d.embedding) == HIDDEN_SIZE for d in emb.data)
            assert emb.usage.prompt_tokens > 0
            chat = await client.chat.completions.create(
                model=SERVED_MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
            )
            assert chat.choices[0].message.content is not None
        pool = mixed.svc.pool
        generate = pool.get(servers[0].url[7:])
        pooling = pool.get(pooling_server.url[7:])
        assert generate is not None
        assert pooling is not None
        for _ in range(6):  # until round robin has offered the pooling server a chat too
            if "chat" in pooling.lacks:
                break
            chat = await client.chat.completions.create(
                model=SERVED_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert chat.choices[0].message.content is not None
    # Each server told the gateway what it lacks: no more requests go to it for those.
    assert "embeddings" in generate.lacks
    assert "chat" in pooling.lacks


async def test_score_rerank_tokenize_and_detokenize_through_the_gateway(
    mixed: RunningGateway, http: httpx.AsyncClient
) -> None:
    docs = ["a gateway in front of vLLM", "a recipe for bread"]
    r = await http.post(
        f"{mixed.url}/score",
        json={"model": SERVED_MODEL, "queries": "vLLM gateway", "documents": docs},
    )
    assert r.status_code == 200, r.text
    assert [d["index"] for d in r.json()["data"]] == [0, 1]
    r = await http.post(
        f"{mixed.url}/v1/rerank",
        json={"model": SERVED_MODEL, "query": "vLLM gateway", "documents": docs, "top_n": 1},
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == 1
    assert results[0]["document"]["text"] in docs
    r = await http.post(
        f"{mixed.url}/tokenize",
        json={"model": SERVED_MODEL, "prompt": "hello world", "add_special_tokens": False},
    )
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert r.json()["count"] == len(tokens) > 0
    r = await http.post(f"{mixed.url}/detokenize", json={"model": SERVED_MODEL, "tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == "hello world"


async def test_an_endpoint_no_server_has_and_bad_bodies_are_openai_errors(
    mixed: RunningGateway, http: httpx.AsyncClient
) -> None:
    r = await http.post(f"{mixed.url}/classify", json={"model": SERVED_MODEL, "input": "hi"})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "endpoint_not_served"
    r = await http.post(f"{mixed.url}/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    r = await http.post(f"{mixed.url}/v1/embeddings", json={"model": SERVED_MODEL})
    assert r.status_code == 400, r.text  # vLLM's own validation, in its envelope
    assert "error" in r.json()
    r = await http.post(
        f"{mixed.url}/v1/embeddings", content=b"{", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"


async def test_stored_responses_come_back_from_the_server_that_made_them(
    gateway: RunningGateway, servers: list[VllmServer]
) -> None:
    """Two servers, equally loaded: without the gateway's memory of where each response is,
    about half the retrievals would reach the server that does not hold it (a 404)."""
    async with openai.AsyncOpenAI(
        base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=60.0
    ) as client:
        made = await client.responses.create(model=SERVED_MODEL, input="hello", max_output_tokens=4)
        assert made.id.startswith("resp_")
        assert made.usage is not None
        assert made.usage.output_tokens > 0
        for _ in range(4):
            again = await client.responses.retrieve(made.id)
            assert again.id == made.id
            assert again.output_text == made.output_text
        follow = await client.responses.create(
            model=SERVED_MODEL,
            input="and then?",
            previous_response_id=made.id,
            max_output_tokens=4,
        )
        assert follow.previous_response_id == made.id
        stream = await client.responses.create(
            model=SERVED_MODEL, input="stream it", max_output_tokens=4, stream=True
        )
        kinds, rid = [], None
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.created":
                rid = event.response.id
        assert kinds[0] == "response.created"
        assert kinds[-1] == "response.completed"
        assert rid is not None
        for _ in range(2):
            assert (await client.responses.retrieve(rid)).id == rid
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_nobody")


ADMIN = "lora-admin-token"


async def test_an_adapter_served_by_one_of_two_servers_is_routed_only_there_and_loaded_live(
    servers: list[VllmServer], lora_server: VllmServer, http: httpx.AsyncClient
) -> None:
    async with gateway_for(
        [servers[0], lora_server], policy="round_robin", admin={"token": ADMIN}
    ) as gw:
        assert gw.admin_url is not None
        pool = gw.svc.pool
        plain, with_lora = pool.get(servers[0].url[7:]), pool.get(lora_server.url[7:])
        assert plain is not None
        assert with_lora is not None
        async with openai.AsyncOpenAI(
            base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=60.0
        ) as client:
            assert "tiny-lora" in {m.id for m in (await client.models.list()).data}
            before = plain.sent_total
            for _ in range(4):
                done = await client.completions.create(model="tiny-lora", prompt="hi", max_tokens=3)
                assert done.model == "tiny-lora"
            assert plain.sent_total == before  # round robin, yet none went to the other one
            # Loaded at run time on every server of the base model: the one without
            # --enable-lora refuses, and is reported; the adapter is then routed like the first.
            auth = {"Authorization": f"Bearer {ADMIN}"}
            load = {
                "lora_name": "tiny-lora-2",
                "lora_path": str(lora_server.log_path.parent / "tiny-lora-2"),
                "model": SERVED_MODEL,
            }
            r = await http.post(f"{gw.admin_url}/admin/lora/load", json=load, headers=auth)
            assert r.status_code == 200, r.text
            assert r.json()["loaded"] == [with_lora.id]
            assert list(r.json()["failed"]) == [plain.id]
            done = await client.completions.create(model="tiny-lora-2", prompt="hi", max_tokens=3)
            assert done.model == "tiny-lora-2"
            assert plain.sent_total == before
            r = await http.post(
                f"{gw.admin_url}/admin/lora/unload", json={"lora_name": "tiny-lora-2"}, headers=auth
            )
            assert r.status_code == 200, r.text
            assert r.json()["unloaded"] == [with_lora.id]
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="tiny-lora-2", prompt="hi", max_tokens=3)
