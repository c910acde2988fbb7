"""A chat request's messages and tools, converted as vLLM converts them for the template.

OpenAI messages become the conversation the template renders (text parts joined, or kept as
parts for a template that loops over content; tool calls with their arguments decoded;
developer messages made system ones for templates without that role), and request tools
their ``model_dump()``. Anything that is not text (images, audio, ...) is refused. Also the
prompt ids a disaggregated chat's decode half reuses instead of rendering.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from gateway.tokenizer.chat_template import ContentFormat
from gateway.tokenizer.protocol import _is_token_ids, _refuse

# --------------------------------------------------------------------------------------------
# Messages, as vLLM parses them before the template sees them: vllm/renderers/chat_utils.py
# `_parse_chat_message_content`, `_parse_chat_message_content_parts`,
# `_parse_chat_message_content_part`, `_postprocess_messages`; the part and tool-call shapes are
# those pydantic leaves after validating ChatCompletionRequest.messages.

# Content part types read as text, and the key holding their text (MM_PARSER_MAP).
_TEXT_PARTS: Final = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# `_KNOWN_CONTENT_PART_FIELDS`: what is not carried over as an "extra field" of a text part.
# fmt: off
_KNOWN_PART_FIELDS: Final = frozenset({
    "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil",
    "image_url", "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text", "thinking",
    "type", "uuid", "video_embeds", "video_url",
})
# fmt: on
# `_MEDIA_CONTENT_PART_KEYS`: a part carrying one of these is multimodal, whatever its type.
# fmt: off
_MEDIA_PART_KEYS: Final = frozenset({
    "audio_embeds", "audio_url", "image_embeds", "image_pil", "image_url", "input_audio",
    "input_image", "prompt_embeds", "video_embeds", "video_url",
})
# fmt: on
_CLAUDE_CODE_BILLING_HEADER: Final = "x-anthropic-billing-header"


def _part_text(part: Any) -> tuple[str, dict[str, Any]]:
    """(text, extra fields) of one content part; refuses anything that is not text."""
    if isinstance(part, str):
        return part, {}
    if not isinstance(part, dict):
        raise _refuse("a content part is neither a string nor an object")
    if "uuid" in part or not _MEDIA_PART_KEYS.isdisjoint(part):
        raise _refuse("multimodal content")
    kind = part.get("type")
    key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if key is None:
        raise _refuse(f"content part of type {kind!r}")
    text = part.get(key)
    if not isinstance(text, str):
        raise _refuse("a text part without a string")
    return text, {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """vllm/renderers/chat_utils.py `_strip_claude_code_billing_header` (system messages)."""
    out: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            text: object = part
        elif isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(_CLAUDE_CODE_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if not rest:
            continue
        out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _tool_calls(value: Any) -> list[dict[str, Any]] | None:
    """An assistant message's tool calls as the template sees them: pydantic's field order
    (id, function{arguments, name}, type, then any extra keys), then `_postprocess_messages`
    (arguments decoded from JSON; anything but an object becomes {}; an empty list is dropped)."""
    if not isinstance(value, list):
        raise _refuse("tool_calls is not a list")
    calls: list[dict[str, Any]] = []
    for item in value:
        if not isinstance(item, dict) or item.get("type") != "function":
            raise _refuse("a tool call that is not a function call")
        fn = item.get("function")
        if (
            not isinstance(item.get("id"), str)
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
        ):
            raise _refuse("a tool call without id, function.name or function.arguments")
        raw = fn["arguments"]
        parsed: Any = {}
        if raw:
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = {}
            if not isinstance(parsed, dict):
                parsed = {}
        function = {
            "arguments": parsed,
            "name": fn["name"],
            **{k: v for k, v in fn.items() if k not in ("arguments", "name")},
        }
        calls.append(
            {
                "id": item["id"],
                "function": function,
                "type": "function",
                **{k: v for k, v in item.items() if k not in ("id", "function", "type")},
            }
        )
    return calls or None


def _content_parts(role: str, content: Any) -> list[tuple[str, dict[str, Any]]]:
    """(text, extra fields) of each part of a message's content; a string is one text part."""
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise _refuse("content is neither a string nor a list")
    if role == "system":
        parts = _strip_billing_header(parts)
    return [_part_text(p) for p in parts]


def _role_fields(role: str, message: Mapping[str, Any], out: dict[str, Any]) -> None:
    """The fields vLLM carries over for assistant and tool messages."""
    if role == "assistant":
        if message.get("tool_calls") is not None:
            calls = _tool_calls(message["tool_calls"])
            if calls is not None:
                out["tool_calls"] = calls
        reasoning = message.get("reasoning")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise _refuse("reasoning is not a string")
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning  # kept for older templates
    elif role == "tool":
        if "tool_call_id" in message:
            call_id = message["tool_call_id"]
            if call_id is not None and not isinstance(call_id, str):
                raise _refuse("tool_call_id is not a string")
            out["tool_call_id"] = call_id
        if isinstance(out["content"], list):
            # Tool results given as text parts become one string.
            out["content"] = "\n".join(p["text"] for p in out["content"])


def _message(message: Any, content_format: ContentFormat) -> dict[str, Any]:
    """One ConversationMessage, as `_parse_chat_message_content` builds it."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _refuse("a message without a role")
    role: str = message["role"]
    texts = _content_parts(role, message.get("content"))
    out: dict[str, Any] = {"role": role}
    if content_format == "openai":
        out["content"] = [{"type": "text", "text": t, **extra} for t, extra in texts]
    else:
        out["content"] = "\n".join(t for t, _ in texts)
    _role_fields(role, message, out)
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if isinstance(message.get("task"), str):
        out["task"] = message["task"]
    if role == "developer":
        if message.get("tools") is not None:
            raise _refuse("tools on a developer message")
        out["tools"] = None
    return out


def _developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vllm/renderers/hf.py `_convert_developer_to_system` then `_consolidate_system_messages`,
    for templates that do not know the developer role."""
    converted: list[dict[str, Any]] = []
    for msg in conversation:
        if msg["role"] == "developer":
            system = {k: v for k, v in msg.items() if k != "tools"}
            system["role"] = "system"
            converted.append(system)
        else:
            converted.append(msg)
    system_contents: list[str] = []
    others: list[dict[str, Any]] = []
    needs_merge = False
    for i, msg in enumerate(converted):
        if msg["role"] != "system":
            others.append(msg)
            continue
        if i > 0 or system_contents:
            needs_merge = True
        content = msg.get("content", "")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, dict) and "text" in part:
                    texts.append(part["text"])
                elif isinstance(part, str):
                    texts.append(part)
            content = "\n".join(texts)
        if content:
            system_contents.append(content)
    if not needs_merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_contents)}, *others]


def _tool_dicts(value: Any) -> list[dict[str, Any]] | None:
    """``[tool.model_dump() for tool in request.tools]`` (vllm/renderers/online_renderer.py
    `render_chat`): ChatCompletionToolsParam and FunctionDefinition, whose serializers drop
    unknown keys and the optional flags left unset."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise _refuse("tools is not a list, or empty (which vLLM rejects)")
    tools: list[dict[str, Any]] = []
    for tool in value:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _refuse("a tool that is not a function")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _refuse("a tool without function.name")
        description = fn.get("description")
        parameters = fn.get("parameters")
        strict = fn.get("strict")
        defer = fn.get("defer_loading")
        tool_defer = tool.get("defer_loading")
        if (
            (description is not None and not isinstance(description, str))
            or (parameters is not None and not isinstance(parameters, dict))
            or any(v is not None and not isinstance(v, bool) for v in (strict, defer, tool_defer))
        ):
            raise _refuse("a tool field of the wrong type")
        if tool_defer is not None and defer is None:
            defer = tool_defer  # ChatCompletionToolsParam._propagate_defer_loading
        function: dict[str, Any] = {
            "name": fn["name"],
            "description": description,
            "parameters": parameters,
        }
        if strict is not None:
            function["strict"] = strict
        if defer is not None:
            function["defer_loading"] = defer
        dumped: dict[str, Any] = {"type": "function", "function": function}
        if tool_defer is not None:
            dumped["defer_loading"] = tool_defer
        tools.append(dumped)
    return tools


def _reused_prompt_token_ids(doc: Mapping[str, Any]) -> list[int] | None:
    """vllm/renderers/online_renderer.py `_reused_prompt_token_ids`: the decode half of a
    disaggregated chat carries the prefill's ids in kv_transfer_params and vLLM uses them as
    they are (not with echo, nor with non-text content, which are rendered instead)."""
    kv = doc.get("kv_transfer_params")
    if not isinstance(kv, dict) or kv.get("prompt_token_ids") is None:
        return None
    if doc.get("echo"):
        return None
    for message in doc.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and (
                    not _MEDIA_PART_KEYS.isdisjoint(part)
                    or part.get("type", "text") not in (*_TEXT_PARTS, "tool_reference")
                ):
                    return None
    ids = kv["prompt_token_ids"]
    if not _is_token_ids(ids):
        raise _refuse("kv_transfer_params.prompt_token_ids is not a list of token ids")
    return list(ids)
