"""The gateway reads a Messages body as vLLM renders it: ``gateway.request.messages.chat_view``
gives the chat messages and tools vLLM's own converter gives (``AnthropicServingMessages.
to_chat_completion_request``, run in the vLLM virtualenv, offline: no server needed). What the
policies hash and the tokenizer renders for a Messages request is then what the engine sees."""

from __future__ import annotations

import json
import subprocess
from typing import Any, Final

from gateway.request.messages import chat_view
from tests.e2e.servers import vllm_python

_VLLM_VIEW: Final = """
import json, sys
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages as S
out = []
for doc in json.load(sys.stdin):
    req = S.to_chat_completion_request(AnthropicMessagesRequest.model_validate(doc))
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    out.append({"messages": req.messages, "tools": tools})
print(json.dumps(out))
"""

WEATHER: Final = {
    "name": "weather",
    "description": "Today's weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
BODIES: Final[list[dict[str, Any]]] = [
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hello"}]},
    {
        "model": "m",
        "max_tokens": 5,
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
            {"role": "assistant", "content": "Hi."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "One"}, {"type": "text", "text": "two"}],
            },
        ],
    },
    {
        "model": "m",
        "max_tokens": 5,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=77;"},
            {"type": "text", "text": "You are "},
            {"type": "text", "text": "a helper."},
        ],
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "sig"},
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "toolu_01",
                        "name": "weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01", "content": "sunny"},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    },
    {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {"role": "user", "content": "Go"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "t1", "name": "weather", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ],
            },
        ],
    },
]


def test_the_chat_view_of_a_messages_body_is_vllms() -> None:
    done = subprocess.run(
        [str(vllm_python()), "-c", _VLLM_VIEW],
        input=json.dumps(BODIES),
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    for body, vllm in zip(BODIES, theirs, strict=True):
        ours = chat_view(body)
        assert ours["messages"] == vllm["messages"], body
        assert ours.get("tools", []) == vllm["tools"], body
