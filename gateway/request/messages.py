"""Anthropic's Messages body as the chat body vLLM renders it. Pure: a document in, one out.

vLLM serves ``/v1/messages`` by turning the request into a chat completion
(``vllm/entrypoints/anthropic/serving.py``, ``to_chat_completion_request``): the top-level
``system`` (a string, or text blocks joined) first as a system message, then each message, its
text blocks as content, ``thinking`` as the message's reasoning, ``tool_use`` blocks as the
assistant's ``tool_calls``, a user's ``tool_result`` blocks as ``tool`` messages before it, the
tools as functions. The gateway reads that view where it reads a chat body: the prompt the
policies hash for prefix affinity and the tokenizer renders for precise prefix routing, the
limits' estimate of the prompt. The body the backend gets is the client's, unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

# Claude Code's attribution line: a per-request hash vLLM drops so it does not defeat the cache.
_BILLING_HEADER: Final = "x-anthropic-billing-header"
# Fields of the Messages body that mean the same in a chat body (``max_tokens`` sizes the
# completion budget; ``cache_salt`` keeps a salted prompt out of everyone's prefix; the
# sampling ones make a continuation sample as the first backend did).
_SAME_FIELDS: Final = (
    "model",
    "max_tokens",
    "stream",
    "cache_salt",
    "chat_template_kwargs",
    "temperature",
    "top_p",
    "top_k",
    "vllm_xargs",
)
# Anthropic's tool_choice types as chat's (a named tool is chat's named function).
_TOOL_CHOICE: Final = {"auto": "auto", "any": "required", "none": "none"}


def chat_view(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The chat body vLLM renders a Messages request ``doc`` as (malformed parts left out:
    vLLM refuses those with a 400 of its own)."""
    out: dict[str, Any] = {k: doc[k] for k in _SAME_FIELDS if k in doc}
    messages: list[dict[str, Any]] = []
    system = _system_text(doc.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    raw = doc.get("messages")
    for m in raw if isinstance(raw, list) else ():
        if isinstance(m, dict):
            _convert(m, messages)
    out["messages"] = messages
    if isinstance(doc.get("stop_sequences"), list):
        out["stop"] = doc["stop_sequences"]
    tools = _tools(doc.get("tools"))
    if tools:
        out["tools"] = tools
        out["tool_choice"] = _tool_choice(doc.get("tool_choice"))
    return out


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return _TOOL_CHOICE.get(str(kind), "auto")


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        return ""
    return "".join(
        b["text"]
        for b in system
        if isinstance(b, dict)
        and b.get("type") == "text"
        and isinstance(b.get("text"), str)
        and not b["text"].startswith(_BILLING_HEADER)
    )


@dataclass(slots=True)
class _Blocks:
    """One message's blocks, sorted as vLLM sorts them."""

    role: Any
    parts: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)


def _convert(m: dict[str, Any], out: list[dict[str, Any]]) -> None:
    role, content = m.get("role"), m.get("content")
    if role == "system":
        text = content if isinstance(content, str) else _system_text(content)
        if text and not text.startswith(_BILLING_HEADER):
            out.append({"role": "system", "content": text})
        return
    message: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        message["content"] = content
        out.append(message)
        return
    blocks = _Blocks(role)
    for block in content if isinstance(content, list) else ():
        if isinstance(block, dict):
            _block(block, blocks, out)
    if blocks.reasoning:
        message["reasoning"] = "".join(blocks.reasoning)
    if blocks.calls:
        message["tool_calls"] = blocks.calls
    parts = blocks.parts
    if len(parts) == 1 and parts[0]["type"] == "text":
        message["content"] = parts[0]["text"]
    elif parts:
        message["content"] = parts
    if not (role == "user" and "content" not in message):
        out.append(message)


def _block(block: dict[str, Any], into: _Blocks, out: list[dict[str, Any]]) -> None:
    kind = block.get("type")
    if kind == "text" and isinstance(block.get("text"), str) and block["text"]:
        into.parts.append({"type": "text", "text": block["text"]})
    elif kind == "thinking" and isinstance(block.get("thinking"), str):
        into.reasoning.append(block["thinking"])
    elif kind == "tool_use":
        into.calls.append(
            {
                "id": str(block.get("id") or ""),
                "type": "function",
                "function": {
                    "name": str(block.get("name") or ""),
                    "arguments": json.dumps(block.get("input") or {}),
                },
            }
        )
    elif kind == "tool_result":
        result = block.get("content")
        if into.role != "user":
            into.parts.append({"type": "text", "text": f"Tool result: {result or ''}"})
            return
        if isinstance(result, list):
            result = "\n".join(
                str(i.get("text", ""))
                for i in result
                if isinstance(i, dict) and i.get("type") == "text"
            )
        out.append(
            {
                "role": "tool",
                "tool_call_id": str(block.get("tool_use_id") or ""),
                "content": result if isinstance(result, str) else "",
            }
        )


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        return []
    return [
        {
            "type": "function",
            "function": {
                "name": t.get("name"),
                "description": t.get("description"),
                "parameters": t.get("input_schema"),
            },
        }
        for t in tools
        if isinstance(t, dict)
    ]
