"""The OpenAI API through the gateway to real vLLM servers, called with the official client."""

from __future__ import annotations

import uuid
from typing import Any

import openai
import pytest

from tests.e2e.observe import log_lines
from tests.e2e.servers import MAX_MODEL_LEN, SERVED_MODEL, VllmServer

N_TOKENS = 12
MESSAGES: list[Any] = [{"role": "user", "content": "Say hello to the gateway."}]
# ignore_eos: a random-weight model may emit its end token at once; a fixed length keeps
# every assertion about counts exact. return_token_ids lets stream and non-stream be compared
# token for token (comparing text would depend on how partial UTF-8 bytes are held back).
EXACT: dict[str, Any] = {"ignore_eos": True, "return_token_ids": True}


def new_request_id(kind: str) -> str:
    return f"e2e-{kind}-{uuid.uuid4().hex[:12]}"


def extra(obj: Any, name: str) -> Any:
    """A vLLM field the openai types do not declare (kept in pydantic's extras)."""
    return (obj.model_extra or {}).get(name)


async def test_models_lists_the_model_both_servers_serve(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [SERVED_MODEL]


async def test_chat_completion(client: openai.AsyncOpenAI, servers: list[VllmServer]) -> None:
    rid = new_request_id("chat")
    resp = await client.chat.completions.create(
        model=SERVED_MODEL,
        messages=MESSAGES,
        max_tokens=N_TOKENS,
        temperature=0.0,
        extra_body=EXACT,
        extra_headers={"X-Request-Id": rid},
    )
    assert resp.id == f"chatcmpl-{rid}"  # vLLM took the gateway's request id
    assert resp.model == SERVED_MODEL
    [choice] = resp.choices
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert resp.usage is not None
    assert resp.usage.completion_tokens == N_TOKENS
    assert resp.usage.prompt_tokens > 0
    assert len(extra(choice, "token_ids")) == N_TOKENS
    assert len(log_lines(servers, "Received request", f"chatcmpl-{rid}")) == 1


async def test_chat_completion_stream_carries_every_token(client: openai.AsyncOpenAI) -> None:
    whole = await client.chat.completions.create(
        model=SERVED_MODEL,
        messages=MESSAGES,
        max_tokens=N_TOKENS,
        temperature=0.0,
        extra_body=EXACT,
    )
    rid = new_request_id("chat-stream")
    stream = await client.chat.completions.create(
        model=SERVED_MODEL,
        messages=MESSAGES,
        max_tokens=N_TOKENS,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXACT,
        extra_headers={"X-Request-Id": rid},
    )
    chunks = [chunk async for chunk in stream]

    assert {c.id for c in chunks} == {f"chatcmpl-{rid}"}
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage is not None
    assert usage.completion_tokens == N_TOKENS
    streamed_ids = [t for c in chunks for ch in c.choices for t in extra(ch, "token_ids") or []]
    # Greedy decoding on the same weights: the stream relayed every token the engine made.
    assert streamed_ids == extra(whole.choices[0], "token_ids")
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == (
        whole.choices[0].message.content
    )


async def test_completion(client: openai.AsyncOpenAI, servers: list[VllmServer]) -> None:
    rid = new_request_id("cmpl")
    resp = await client.completions.create(
        model=SERVED_MODEL,
        prompt="The gateway",
        max_tokens=N_TOKENS,
        temperature=0.0,
        extra_body=EXACT,
        extra_headers={"X-Request-Id": rid},
    )
    assert resp.id == f"cmpl-{rid}"
    assert resp.object == "text_completion"
    [choice] = resp.choices
    assert choice.finish_reason == "length"
    assert isinstance(choice.text, str)
    assert resp.usage is not None
    assert resp.usage.completion_tokens == N_TOKENS
    assert len(extra(choice, "token_ids")) == N_TOKENS
    assert len(log_lines(servers, "Received request", f"cmpl-{rid}")) == 1


async def test_completion_stream_carries_every_token(client: openai.AsyncOpenAI) -> None:
    whole = await client.completions.create(
        model=SERVED_MODEL,
        prompt="The gateway",
        max_tokens=N_TOKENS,
        temperature=0.0,
        extra_body=EXACT,
    )
    stream = await client.completions.create(
        model=SERVED_MODEL,
        prompt="The gateway",
        max_tokens=N_TOKENS,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXACT,
    )
    chunks = [chunk async for chunk in stream]

    assert all(c.object == "text_completion" for c in chunks)
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == N_TOKENS
    streamed_ids = [t for c in chunks for ch in c.choices for t in extra(ch, "token_ids") or []]
    assert streamed_ids == extra(whole.choices[0], "token_ids")
    assert "".join(ch.text for c in chunks for ch in c.choices) == whole.choices[0].text


async def test_vllm_rejection_passes_through(client: openai.AsyncOpenAI) -> None:
    """vLLM's own 400 (max_tokens beyond the model's context) reaches the client unchanged."""
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(
            model=SERVED_MODEL, prompt="hi", max_tokens=MAX_MODEL_LEN + 1
        )
    assert caught.value.status_code == 400
    assert str(MAX_MODEL_LEN) in caught.value.message


async def test_unknown_model_is_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
