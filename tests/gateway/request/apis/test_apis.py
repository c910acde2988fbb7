"""What each API does differently, asked through ``gateway.request.api.Api`` as the request
path asks it: the view limits and routing read, the prompt's ids, the stream's continuation,
the id upstream, what is kept while it runs; and the table's rows name them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, cast

import pytest

from gateway.request.api import PLAIN, Plain
from gateway.request.apis.chat import CHAT_API, COMPLETIONS_API
from gateway.request.apis.generate import GENERATE_API
from gateway.request.apis.messages import MESSAGES_API, MESSAGES_SIDE_API
from gateway.request.continuation import Progress
from gateway.request.dialects import ANTHROPIC, OPENAI
from gateway.request.endpoints import (
    CHAT,
    COMPLETIONS,
    COUNT_TOKENS,
    EMBEDDINGS,
    ENDPOINTS,
    GENERATE,
    MESSAGES,
    RESPONSES,
    TOKENIZE,
)
from gateway.request.generate import Generations
from gateway.request.messages_resume import CHAT_PATH, MessagesProgress
from gateway.request.record import RequestRecord
from gateway.request.services import Services

CHAT_BODY: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 10,
    "stream": True,
}
MESSAGES_BODY: dict[str, Any] = {
    "model": "m",
    "max_tokens": 10,
    "system": "be brief",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
}
GENERATE_BODY: dict[str, Any] = {
    "model": "m",
    "token_ids": [5, 6, 7],
    "sampling_params": {"max_tokens": 10},
    "stream": True,
}


class _Tokenizers:
    def __init__(self) -> None:
        self.asked: list[tuple[str, str, Any]] = []

    async def tokens(self, model: str, kind: str, doc: Any) -> list[int]:
        self.asked.append((model, kind, doc))
        return [1, 2, 3]


class _Svc:
    """The services an API reads (a Services in the gateway)."""

    def __init__(self) -> None:
        self.asked = _Tokenizers()
        self.tokenizers: _Tokenizers | None = self.asked
        self.generations = Generations()


def svc(s: _Svc) -> Services:
    return cast(Services, s)


def test_the_table_names_an_api_and_a_dialect_for_every_endpoint() -> None:
    by_api = {e.name: e.api for e in ENDPOINTS}
    assert by_api["chat"] is CHAT_API
    assert by_api["completions"] is COMPLETIONS_API
    assert by_api["generate"] is GENERATE_API
    assert by_api["messages"] is MESSAGES_API
    assert by_api["count_tokens"] is MESSAGES_SIDE_API
    assert by_api["embeddings"] is PLAIN
    assert by_api["transcriptions"] is PLAIN
    assert {e.dialect for e in ENDPOINTS} == {OPENAI, ANTHROPIC}
    assert MESSAGES.dialect is ANTHROPIC
    assert COUNT_TOKENS.dialect is ANTHROPIC
    assert CHAT.dialect is OPENAI
    # where vLLM reads the gateway's priority, and which streams carry tokens
    assert (CHAT.priority, GENERATE.priority, EMBEDDINGS.priority) == ("header", "body", "body")
    assert TOKENIZE.priority is None
    assert all(e.streams_tokens for e in (CHAT, COMPLETIONS, RESPONSES, MESSAGES, GENERATE))
    assert not EMBEDDINGS.streams_tokens


async def test_chat_and_completions_tokenize_their_prompt_as_their_kind() -> None:
    s = _Svc()
    assert await CHAT_API.prompt_ids(svc(s), "m", CHAT_BODY, CHAT_BODY) == [1, 2, 3]
    doc = {"model": "m", "prompt": "once"}
    assert await COMPLETIONS_API.prompt_ids(svc(s), "m", doc, doc) == [1, 2, 3]
    assert [(m, kind) for m, kind, _ in s.asked.asked] == [("m", "chat"), ("m", "completions")]
    s.tokenizers = None  # no tokenizer configured: no ids, nothing asked
    assert await CHAT_API.prompt_ids(svc(s), "m", CHAT_BODY, CHAT_BODY) is None


async def test_an_api_without_a_prompt_of_its_own_has_no_ids_and_keeps_its_body() -> None:
    s = _Svc()
    doc = {"model": "m", "input": "x"}
    assert await PLAIN.prompt_ids(svc(s), "m", doc, doc) is None
    assert PLAIN.view(doc) is doc
    assert PLAIN.continuing({**doc, "stream": True}) is None
    assert PLAIN.upstream_id({}, {"request_id": "mine"}, "rid") == "rid"
    assert s.asked.asked == []


@pytest.mark.parametrize(
    ("extra", "continued"),
    [({}, True), ({"n": 2}, False), ({"stream": False}, False), ({"logprobs": True}, False)],
)
def test_a_chat_stream_is_continued_only_where_it_can_be_faithfully(
    extra: dict[str, Any], continued: bool
) -> None:
    continuing = CHAT_API.continuing({**CHAT_BODY, **extra})
    assert (continuing is not None) is continued


def test_a_chat_continuation_asks_for_the_rest_on_its_own_path() -> None:
    continuing = CHAT_API.continuing(CHAT_BODY)
    assert continuing is not None
    assert continuing.path is None
    progress = continuing.progress()
    progress.feed(
        b'data: {"id":"c1","created":5,"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
    )
    assert continuing.blocker(progress) is None
    body, stitch = continuing.rest(progress, 1)
    assert body["max_tokens"] == 9  # lowered by what was sent
    assert body["messages"][-1] == {"role": "assistant", "content": "Hel"}
    assert stitch.cut is None
    progress.feed(b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"id":"t"}]}}]}\n\n')
    assert continuing.blocker(progress) == "tool_call"


def test_a_messages_stream_goes_on_as_the_chat_vllm_renders() -> None:
    assert MESSAGES_API.view(MESSAGES_BODY)["messages"][0] == {
        "role": "system",
        "content": "be brief",
    }
    assert MESSAGES_SIDE_API.continuing(MESSAGES_BODY) is None  # count_tokens, render
    continuing = MESSAGES_API.continuing(MESSAGES_BODY)
    assert continuing is not None
    assert continuing.path == CHAT_PATH
    progress = continuing.progress()
    assert isinstance(progress, MessagesProgress)
    progress.blocker = "tool_use"
    assert continuing.blocker(progress) == "tool_use"
    progress.blocker = None
    progress.text.append("Hel")
    body, _ = continuing.rest(progress, 1)
    assert body["continue_final_message"] is True
    assert body["messages"][-1] == {"role": "assistant", "content": "Hel"}
    assert MESSAGES_API.continuing({**MESSAGES_BODY, "stream": False}) is None


async def test_generate_routes_by_its_own_ids_and_continues_from_the_ids_sent() -> None:
    s = _Svc()
    assert await GENERATE_API.prompt_ids(svc(s), "m", GENERATE_BODY, {}) == [5, 6, 7]
    assert s.asked.asked == []  # token ids: nothing to tokenize
    assert GENERATE_API.view(GENERATE_BODY)["prompt"] == [5, 6, 7]
    continuing = GENERATE_API.continuing(GENERATE_BODY)
    assert continuing is not None
    progress = continuing.progress()
    assert isinstance(progress, Progress)
    assert not progress.chat
    progress.feed(b'data: {"choices":[{"index":0,"token_ids":[8,9],"text":""}]}\n\n')
    body, _ = continuing.rest(progress, 2)
    assert body["token_ids"] == [5, 6, 7, 8, 9]
    assert body["sampling_params"]["max_tokens"] == 8
    assert GENERATE_API.continuing({**GENERATE_BODY, "sampling_params": {"n": 2}}) is None


def test_generate_goes_upstream_by_the_id_the_client_aborts_by() -> None:
    mine = {**GENERATE_BODY, "request_id": "mine"}
    assert GENERATE_API.upstream_id({}, mine, "rid") == "mine"
    assert GENERATE_API.upstream_id({"X-Request-Id": "hdr"}, mine, "rid") == "rid"
    assert GENERATE_API.upstream_id({}, {**mine, "request_id": "bad id\n"}, "rid") == "rid"
    assert GENERATE_API.upstream_id({}, GENERATE_BODY, "rid") == "rid"


def test_a_generation_is_findable_while_it_runs_and_only_then() -> None:
    s = _Svc()
    record = RequestRecord("rid", started=0.0, endpoint="generate")
    record.backends.append("b1")
    kept = GENERATE_API.serving(svc(s), "mine", "key-a", record)
    assert kept is not None
    with kept:
        where, unknown = s.generations.placed(["mine"], "key-a")
        assert where == {"b1": ["mine"]}
        assert unknown == []
        assert s.generations.placed(["mine"], "key-b") == ({}, ["mine"])  # not the owner's
    assert len(s.generations) == 0
    kept = GENERATE_API.serving(svc(s), "x", "key-a", record)
    assert kept is not None
    with pytest.raises(RuntimeError), kept:
        raise RuntimeError
    assert len(s.generations) == 0  # ended on the way out, whatever it raised
    assert PLAIN.serving(svc(s), "y", "key-a", record) is None  # the plain API keeps nothing


def test_the_dialects_end_streams_and_reshape_errors_in_their_own_shapes() -> None:
    assert OPENAI.stream_end() == b"data: [DONE]\n\n"
    assert ANTHROPIC.stream_end().startswith(b"event: message_stop\n")
    vllm_error = json.dumps({"error": {"message": "no", "type": "BadRequestError"}}).encode()
    assert OPENAI.reshaped(400, vllm_error) == vllm_error
    assert not OPENAI.reshapes_errors
    shaped = json.loads(ANTHROPIC.reshaped(400, vllm_error))
    assert shaped["type"] == "error"
    assert shaped["error"]["message"] == "no"
    assert json.loads(ANTHROPIC.refusal(413, "too big"))["type"] == "error"
    assert "error" in json.loads(OPENAI.refusal(413, "too big"))


def test_a_new_api_is_a_plain_subclass_with_only_what_differs() -> None:
    class Upper(Plain):
        def view(self, doc: dict[str, Any]) -> dict[str, Any]:
            return {**doc, "prompt": str(doc.get("text", "")).upper()}

    assert Upper().view({"text": "hi"})["prompt"] == "HI"
    assert Upper().continuing({"stream": True}) is None  # the rest is Plain's


def test_the_request_path_asks_the_api_and_never_tests_which_it_is() -> None:
    """Outside the API modules and the table, no module of the request path compares an
    endpoint or a dialect with a particular one: what differs is asked of them."""
    request = Path(__file__).resolve().parents[4] / "gateway" / "request"
    tests = re.compile(
        r"\bendpoint\)? (?:is|is not|==|!=) [A-Z]"  # endpoint is CHAT
        r"|\bendpoint (?:not )?in [(A-Z]"  # endpoint in (CHAT, COMPLETIONS)
        r"|dialect\)? ?(?:==|!=)"  # dialect == "anthropic"
    )
    found = [
        f"{path.relative_to(request)}:{n}: {line.strip()}"
        for path in sorted(request.rglob("*.py"))
        if path.parent.name != "apis" and path.name != "endpoints.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if tests.search(line)
    ]
    assert found == []
