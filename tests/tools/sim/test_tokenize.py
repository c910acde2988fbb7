"""What a gateway asks of a backend to continue a broken stream: ``POST /tokenize`` (vLLM
0.32's shape) to count the text already sent, then the prompt followed by that text (a
completion, as a string or token ids; a chat, as a final assistant message to continue)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from gateway.tokenizer.words import tokenize
from tools.sim import FAST, RunningSim
from tools.sim.protocol import ApiError, parse_generate, parse_tokenize

from .conftest import chat_body, completion_body, sse_events

MODEL = FAST.model_name


async def post_json(
    client: aiohttp.ClientSession, url: str, body: Any
) -> tuple[int, dict[str, Any]]:
    async with client.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def streamed(
    client: aiohttp.ClientSession, sim: RunningSim, path: str, body: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """A stream's text and its usage (``include_usage`` is asked)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.post(f"{sim.url}{path}", json=body) as resp:
        assert resp.status == 200, await resp.text()
        events = sse_events(await resp.read())
    assert events[-1] == "[DONE]"
    text = ""
    for e in events[:-2]:
        choice = e["choices"][0]
        text += choice.get("text") or choice.get("delta", {}).get("content") or ""
    return text, events[-2]["usage"]


async def test_tokenize_answers_count_max_model_len_and_ids(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    text = " kai  lous\nzean nope"
    body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
    status, answer = await post_json(client, f"{sim.url}/tokenize", body)
    assert status == 200
    assert answer == {
        "count": 4,
        "max_model_len": FAST.max_model_len,
        "tokens": tokenize(text),
        "token_strs": None,
    }
    # add_special_tokens defaults to true; the simulator's tokenizer has none to add.
    status, plain = await post_json(client, f"{sim.url}/tokenize", {"prompt": text})
    assert (status, plain) == (200, answer)
    body = {"prompt": "a b", "return_token_strs": True}
    assert (await post_json(client, f"{sim.url}/tokenize", body))[1]["token_strs"] == ["a", "b"]
    assert (await post_json(client, f"{sim.url}/tokenize", {"prompt": ""}))[1]["count"] == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_tokenize_counts_a_streams_text_as_the_tokens_it_carried(
    sim: RunningSim, client: aiohttp.ClientSession, path: str
) -> None:
    make = chat_body if path.endswith("chat/completions") else completion_body
    text, usage = await streamed(client, sim, path, make(max_tokens=25, ignore_eos=True))
    body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
    status, answer = await post_json(client, f"{sim.url}/tokenize", body)
    assert status == 200
    assert answer["count"] == usage["completion_tokens"] == 25


async def test_tokenize_of_a_chat_counts_its_prompt(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    body = chat_body("how are you", max_tokens=1)
    _, usage = await streamed(client, sim, "/v1/chat/completions", body)
    status, answer = await post_json(
        client, f"{sim.url}/tokenize", {"model": MODEL, "messages": body["messages"]}
    )
    assert status == 200
    assert answer["count"] == usage["prompt_tokens"]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"prompt": 5}, 400, "prompt: Input should be a valid string"),
        ({"prompt": [1, 2]}, 400, "prompt: Input should be a valid string"),
        ({"model": MODEL}, 400, "prompt: Field required"),
        ({"prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens"),
        ([1], 400, "JSON object"),
        ({"messages": []}, 400, "messages"),
        ({"prompt": "x", "model": "nope"}, 404, "The model `nope` does not exist."),
    ],
)
async def test_tokenize_errors_use_vllms_envelope(
    sim: RunningSim,
    client: aiohttp.ClientSession,
    *,
    body: Any,
    status: int,
    message: str,
) -> None:
    got, answer = await post_json(client, f"{sim.url}/tokenize", body)
    assert got == status
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"]
    assert error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


async def test_tokenize_wants_json(sim: RunningSim, client: aiohttp.ClientSession) -> None:
    async with client.post(f"{sim.url}/tokenize", data=b"prompt=x") as resp:
        assert resp.status == 400
        assert "application/json" in (await resp.json())["error"]["message"]
    headers = {"Content-Type": "application/json"}
    async with client.post(f"{sim.url}/tokenize", data=b"{", headers=headers) as resp:
        assert resp.status == 400


def test_a_continued_chat_prompt_is_the_original_followed_by_the_answer() -> None:
    messages = [{"role": "user", "content": "hello there"}]
    original = parse_generate({"messages": messages}, chat=True).prompt_ids
    sent = " kai lous"
    continued = parse_generate(
        {
            "messages": [*messages, {"role": "assistant", "content": sent}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        chat=True,
    ).prompt_ids
    assert continued == (*original, *tokenize(sent))
    # Without the generation prompt and without a final message to continue:
    no_prompt = {"messages": messages, "add_generation_prompt": False}
    assert parse_generate(no_prompt, chat=True).prompt_ids == original[:-1]


@pytest.mark.parametrize(
    "flags",
    [
        {"continue_final_message": True, "add_generation_prompt": True},
        {"continue_final_message": "yes"},
        {"add_generation_prompt": 0},
    ],
)
def test_chat_prompt_flags_are_validated(flags: dict[str, Any]) -> None:
    body = {"messages": [{"role": "assistant", "content": "x"}], **flags}
    with pytest.raises(ApiError) as info:
        parse_generate(body, chat=True)
    assert info.value.status == 400
    with pytest.raises(ApiError):
        parse_tokenize(body)


async def test_a_chat_continuation_request_is_served(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    sent = " kai lous zean"
    body = chat_body(max_tokens=7, ignore_eos=True, temperature=0.7, top_p=0.9, stop=["\n"])
    body["messages"].append({"role": "assistant", "content": sent})
    body |= {"continue_final_message": True, "add_generation_prompt": False}
    text, usage = await streamed(client, sim, "/v1/chat/completions", body)
    assert len(text.split()) == usage["completion_tokens"] == 7
    # "<|user|> hello there\n<|assistant|>", the three words sent, no second generation prompt
    assert usage["prompt_tokens"] == 4 + 3


async def test_a_completion_continuation_with_token_ids_is_served(
    sim: RunningSim, client: aiohttp.ClientSession
) -> None:
    first, _ = await streamed(
        client, sim, "/v1/completions", completion_body(max_tokens=5, ignore_eos=True)
    )
    prompt = [*tokenize("hello there"), *tokenize(first)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    text, usage = await streamed(client, sim, "/v1/completions", body)
    assert len(text.split()) == usage["completion_tokens"] == 4
    assert usage["prompt_tokens"] == 2 + 5
    # The same continuation as text: the same prompt, so the same answer.
    as_text = {**body, "prompt": "hello there" + first}
    assert await streamed(client, sim, "/v1/completions", as_text) == (text, usage)
