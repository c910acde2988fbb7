"""Anthropic's Messages API as vLLM 0.32 serves it (``vllm/entrypoints/anthropic``). Pure:
a body in, a chat request and the answer's documents or events out.

vLLM runs a Messages request as a chat completion: ``chat_messages`` converts the body as
its ``to_chat_completion_request`` does (the system prompt first, as one system message;
``tool_use`` blocks as the assistant's ``tool_calls``; a user's ``tool_result`` blocks as
``tool`` messages, before the rest of that user message), so the prompt, the engine run
and the faults are the chat route's. The answer is the chat completion's, translated:

- a message ``{"id": "chatcmpl-...", "type": "message", "role": "assistant", "content":
  [...], "model", "stop_reason", "usage"}`` (``stop_sequence`` only when one matched, as
  vLLM drops null fields); ``usage`` is ``input_tokens``/``output_tokens``, and with
  ``--enable-prompt-tokens-details`` ``cache_creation_input_tokens`` and
  ``cache_read_input_tokens`` too, ``input_tokens`` then the prompt tokens neither read
  from nor written to the prefix cache (vLLM's ``_build_anthropic_usage``);
- a stream of named events, no ``[DONE]``: ``message_start`` (usage: the prompt's tokens,
  0 output), ``content_block_start`` with the first token, a ``content_block_delta`` per
  token (``text_delta``, or ``input_json_delta`` for a tool call), ``content_block_stop``,
  ``message_delta`` (``stop_reason``, ``stop_sequence``, the final usage), ``message_stop``.
  No ``ping``. An engine failing mid-stream ends it with ``event: error`` carrying vLLM's
  own ``internal_error`` (its converter chokes on the chat layer's error chunk).
- errors as ``{"type": "error", "error": {"type", "message"}}`` with vLLM's status; a body
  that fails validation is answered before the route, in vLLM's OpenAI envelope
  (``validation.py``).

Tools: the simulator is a server started with a tool parser whose model never calls a tool
unless forced. ``tool_choice`` ``{"type": "tool", "name"}`` (or ``"any"``: the first tool)
makes the answer one ``tool_use`` block, its input built from the tool's ``input_schema``
and seeded by the prompt, generated as the JSON's words; ``stop_reason`` ``tool_use``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace
from typing import Any, Final

from gateway.tokenizer.words import VOCAB, VOCAB_SIZE, word_id
from tools.sim.config import SimConfig
from tools.sim.engine import TokenEvent
from tools.sim.protocol import ApiError, GenerateParams, Outcome, error_envelope, plan_output
from tools.sim.responses import named_event
from tools.sim.tokens import OutputText, mix64, prompt_seed
from tools.sim.validation import Fields, Problems, sanitize

ROLES: Final = ("user", "assistant", "system")
BLOCK_TYPES: Final = (
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
    "tool_addition",
    "tool_removal",
)
TOOL_CHOICES: Final = ("auto", "any", "tool", "none")
# Claude Code's per-request header in the system prompt, dropped by vLLM (prefix caching)
BILLING_HEADER: Final = "x-anthropic-billing-header"
_SCHEMA_DEPTH: Final = 4

# vLLM's Messages stream when the engine fails: the chat layer's error chunk fails the
# converter's ChatCompletionStreamResponse validation, whose message it sends (pydantic 2.14).
_CHOKED: Final = (
    "Field required [type=missing, input_value={'error': {'message': 'In...am': None, "
    "'code': 500}}, input_type=dict]\n"
    "    For further information visit https://errors.pydantic.dev/2.14/v/missing"
)
STREAM_FAILURE: Final = named_event(
    "error",
    {
        "type": "error",
        "error": {
            "type": "internal_error",
            "message": "2 validation errors for ChatCompletionStreamResponse\n"
            f"model\n  {_CHOKED}\nchoices\n  {_CHOKED}",
        },
    },
)


def anthropic_error(exc: ApiError) -> dict[str, Any]:
    """vLLM's ``translate_error_response``: the envelope's type and message, Anthropic's shape."""
    error = error_envelope(exc.status, exc.message, exc.param, exc.kind)["error"]
    return {"type": "error", "error": {"type": error["type"], "message": error["message"]}}


@dataclass(frozen=True, slots=True)
class ForcedTool:
    """The tool a request forces (``tool_choice`` ``tool``, or ``any``: the first one)."""

    name: str
    schema: dict[str, Any]


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A valid Messages (or count_tokens) body, as the chat request vLLM runs."""

    model: str
    messages: list[dict[str, Any]]  # the chat conversation
    max_tokens: int | None  # None for count_tokens
    stream: bool
    stop: tuple[str, ...]
    tool: ForcedTool | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    cache_salt: str | None
    kv_transfer_params: dict[str, Any] | None

    def chat_body(self) -> dict[str, Any]:
        """The equivalent chat completion body (what ``parse_generate`` reads)."""
        body: dict[str, Any] = {"model": self.model, "messages": self.messages}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.stream:
            body["stream"] = True
        if self.stop:
            body["stop"] = list(self.stop)
        if self.kv_transfer_params is not None:
            body["kv_transfer_params"] = self.kv_transfer_params
        return body


def parse_messages(body: Any, *, count_tokens: bool = False) -> MessagesRequest:
    """Validate a ``/v1/messages`` (or ``/count_tokens``) body as vLLM's model does,
    raising ``BodyError``, and convert it to the chat request vLLM runs."""
    fields = Fields.body(body)
    _check(fields, count_tokens=count_tokens)
    return MessagesRequest(
        model=body["model"],
        messages=chat_messages(body),
        max_tokens=None if count_tokens else fields.integer("max_tokens"),
        stream=not count_tokens and bool(fields.boolean("stream")),
        stop=() if count_tokens else tuple(body.get("stop_sequences") or ()),
        tool=forced_tool(body),
        temperature=None if count_tokens else fields.number("temperature"),
        top_p=None if count_tokens else fields.number("top_p"),
        top_k=None if count_tokens else fields.integer("top_k"),
        cache_salt=None if count_tokens else body.get("cache_salt"),
        kv_transfer_params=None if count_tokens else body.get("kv_transfer_params"),
    )


def _check(f: Fields, *, count_tokens: bool) -> None:
    """pydantic's checks of vLLM's AnthropicMessagesRequest (or CountTokensRequest), field
    by field in its order; the errors raised together."""
    model = f.string("model", required=True)
    if model == "":
        f.value_error("model", "Model is required", model)
    for i, message in enumerate(f.array("messages", required=True) or ()):
        m = f.nested(("messages", i), message)
        if m is not None:
            m.literal("role", ROLES, required=True)
            _content(m, "content", required=True)
    if not count_tokens:
        max_tokens = f.integer("max_tokens", required=True)
        if max_tokens is not None and max_tokens <= 0:
            f.value_error("max_tokens", "max_tokens must be positive", f.doc["max_tokens"])
        f.mapping("metadata")
    f.mapping("output_config")
    if count_tokens:
        _content(f, "system")
    f.mapping("thinking")
    if not count_tokens:
        f.strings("stop_sequences")
        f.boolean("stream")
        _content(f, "system")
        f.number("temperature")
    _tool_choice(f)
    for i, tool in enumerate(f.array("tools") or ()):
        t = f.nested(("tools", i), tool)
        if t is not None:
            t.string("name", required=True)
            t.string("description")
            t.mapping("input_schema", required=True)
            t.boolean("strict")
    if not count_tokens:
        f.integer("top_k")
        f.number("top_p")
        salt = f.string("cache_salt")
        if salt is not None and not 1 <= len(salt) <= 1024:
            short = not salt
            f.error(
                "cache_salt",
                "string_too_short" if short else "string_too_long",
                "String should have at least 1 character"
                if short
                else "String should have at most 1024 characters",
                salt,
                **({"min_length": 1} if short else {"max_length": 1024}),
            )
        f.mapping("kv_transfer_params")
        f.mapping("vllm_xargs")
    f.mapping("chat_template_kwargs")
    f.problems.check()


def _content(f: Fields, key: str, *, required: bool = False) -> None:
    """A ``str | list[AnthropicContentBlock]`` field: when both branches fail, pydantic
    reports the string branch's error, then the list branch's."""
    if key not in f.doc:
        if required:
            f.problems.add("missing", (*f.loc, key), "Field required", f.doc)
        return
    value = f.doc[key]
    if isinstance(value, str) or (value is None and not required):
        return
    blocks = Problems()
    if isinstance(value, list):
        inner = Fields(f.doc, f.loc, blocks)
        for i, block in enumerate(value):
            b = inner.nested((key, i), block)
            if b is not None:
                b.literal("type", BLOCK_TYPES, required=True)
                for name in ("text", "id", "tool_use_id", "name", "thinking", "signature"):
                    b.string(name)
                b.mapping("input")
                b.boolean("is_error")
        if not blocks.items:
            return
    f.error(key, "string_type", "Input should be a valid string", value)
    if isinstance(value, list):
        f.problems.items += blocks.items
    else:
        f.error(key, "list_type", "Input should be a valid list", value)


def _tool_choice(f: Fields) -> None:
    value = f.doc.get("tool_choice")
    if value is None:
        return
    choice = f.nested(("tool_choice",), value)
    if choice is None:
        return
    before = len(f.problems.items)
    kind = choice.literal("type", TOOL_CHOICES, required=True)
    name = choice.string("name")
    choice.boolean("disable_parallel_tool_use")
    if len(f.problems.items) == before and kind == "tool" and not name:
        f.value_error("tool_choice", "tool_choice.name is required when type is 'tool'", value)


def _block_text(block: Any) -> str | None:
    """A text block's text, unless empty or Claude Code's billing header."""
    if isinstance(block, dict) and block.get("type") == "text":
        text = block.get("text")
        if isinstance(text, str) and text and not text.startswith(BILLING_HEADER):
            return text
    return None


def _system_text(content: Any) -> str:
    if isinstance(content, str):
        return "" if content.startswith(BILLING_HEADER) else content
    return "".join(t for t in map(_block_text, content or ()) if t)


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation as vLLM's ``to_chat_completion_request`` converts it (for a chat
    template that takes system messages anywhere, as the simulator's does)."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        text = system if isinstance(system, str) else _system_text(system)
        if text:
            out.append({"role": "system", "content": text})
    for msg in body["messages"]:
        role, content = msg["role"], msg["content"]
        if role == "system":
            text = _system_text(content)
            if text:
                out.append({"role": "system", "content": text})
            continue
        converted: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            converted["content"] = content
        else:
            _convert_blocks(content, role, converted, out)
        if not (role == "user" and "content" not in converted):
            out.append(converted)
    return out


def _convert_blocks(
    blocks: list[dict[str, Any]], role: str, converted: dict[str, Any], out: list[dict[str, Any]]
) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id") or f"call_{uuid.uuid4().hex[:8]}",
                    "type": "function",
                    "function": {
                        "name": block.get("name") or "",
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result":
            if role == "user":
                out.extend(_tool_result(block))
            else:
                result = str(block["content"]) if block.get("content") else ""
                parts.append({"type": "text", "text": f"Tool result: {result}"})
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if calls:
        converted["tool_calls"] = calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        converted["content"] = parts[0]["text"]
    elif parts:
        converted["content"] = parts


def _tool_result(block: dict[str, Any]) -> list[dict[str, Any]]:
    """A user's ``tool_result``: a ``tool`` message (its text parts joined by newlines),
    then its images as a user message and its tool references as another tool message."""
    content = block.get("content")
    call_id = block.get("tool_use_id") or ""
    text = content if isinstance(content, str) else ""
    images: list[str] = []
    references: list[dict[str, Any]] = []
    if isinstance(content, list):
        texts: list[str] = []
        for item in content:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "text":
                texts.append(str(item.get("text", "")))
            elif item.get("type") == "image" and (url := _image_url(item.get("source") or {})):
                images.append(url)
            elif item.get("type") == "tool_reference" and (
                ref := item.get("tool_name") or item.get("name")
            ):
                references.append({"type": "tool_reference", "name": ref})
        text = "\n".join(texts)
    messages: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": call_id, "content": text}]
    if images:
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
        messages.append({"role": "user", "content": parts})
    if references:
        messages.append({"role": "tool", "tool_call_id": call_id, "content": references})
    return messages


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    media = source.get("media_type", "image/jpeg")
    return f"data:{media};base64,{source.get('data', '')}"


def forced_tool(body: dict[str, Any]) -> ForcedTool | None:
    """The tool ``tool_choice`` forces, if it forces one (its schema ``{}`` if undeclared)."""
    choice = body.get("tool_choice")
    tools = body.get("tools") or []
    if not isinstance(choice, dict):
        return None
    if choice.get("type") == "tool":
        name = str(choice["name"])
        schema: dict[str, Any] = next(
            (t["input_schema"] for t in tools if t.get("name") == name), {}
        )
        return ForcedTool(name, schema)
    if choice.get("type") == "any" and tools:
        return ForcedTool(tools[0]["name"], tools[0]["input_schema"])
    return None


def tool_input(schema: Any, seed: int, depth: int = 0) -> Any:
    """A value for a JSON schema, the same for the same seed: every property of an object,
    one item of an array, a vocabulary word for a string."""
    if not isinstance(schema, dict):
        return VOCAB[mix64(seed) % VOCAB_SIZE]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[mix64(seed) % len(enum)]
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        props = schema.get("properties")
        if depth >= _SCHEMA_DEPTH or not isinstance(props, dict):
            return {}
        return {k: tool_input(v, mix64(seed ^ word_id(k)), depth + 1) for k, v in props.items()}
    if kind == "array":
        return (
            [tool_input(schema.get("items"), mix64(seed + 1), depth + 1)]
            if depth < _SCHEMA_DEPTH
            else []
        )
    if kind == "integer":
        return mix64(seed) % 100
    if kind == "number":
        return (mix64(seed) % 1000) / 10
    if kind == "boolean":
        return bool(mix64(seed) & 1)
    if kind == "null":
        return None
    return VOCAB[mix64(seed) % VOCAB_SIZE]


def plan_tool(
    params: GenerateParams, config: SimConfig, tool: ForcedTool
) -> tuple[int, str, OutputText]:
    """A forced tool call's answer: the input's JSON, a word a token, then EOS (cut by the
    same context limits and ``max_tokens`` as any answer)."""
    budget, _, _ = plan_output(replace(params, ignore_eos=True, stop=()), config)
    arguments = json.dumps(tool_input(tool.schema, prompt_seed(params.prompt_ids, config.seed)))
    words = tuple(arguments.split(" "))
    if len(words) + 1 <= budget:
        return len(words) + 1, "stop", OutputText(0, words, eos_index=len(words))
    return budget, "length", OutputText(0, words)


def count_tokens_response(input_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "context_management": {"original_input_tokens": input_tokens},
    }


class MessageFormat:
    """Every body of one Messages request: the whole message, or its stream's events
    (a ``StreamFormat``), in vLLM's field order."""

    __slots__ = ("details", "id", "input_tokens", "model", "output", "started", "tool", "tool_id")

    def __init__(
        self,
        message_id: str,
        model: str,
        input_tokens: int,
        output: OutputText,
        tool: ForcedTool | None,
        *,
        details: bool,
    ) -> None:
        self.id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self.output = output
        self.tool = tool
        self.tool_id = f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"  # vLLM's make_tool_call_id
        self.details = details  # --enable-prompt-tokens-details
        self.started = False  # a content block is open

    def usage(self, end: Outcome | None) -> dict[str, int]:
        """vLLM's ``_build_anthropic_usage``; before the end (``message_start``) the prompt
        and no output."""
        if end is None:
            return {"input_tokens": self.input_tokens, "output_tokens": 0}
        if not self.details:
            return {"input_tokens": self.input_tokens, "output_tokens": end.tokens}
        cached, created = end.cached_tokens, end.created_tokens
        return {
            "input_tokens": max(0, self.input_tokens - cached - created),
            "output_tokens": end.tokens,
            "cache_creation_input_tokens": created,
            "cache_read_input_tokens": cached,
        }

    def stop(self, end: Outcome) -> tuple[str | None, str | None]:
        """``(stop_reason, stop_sequence)`` as vLLM's ``_to_anthropic_stop_reason``."""
        if end.finish_reason == "length":
            return "max_tokens", None
        if end.finish_reason != "stop":
            return None, None
        if self.tool is not None:
            return "tool_use", None
        if self.output.stop_reason is not None:
            return "stop_sequence", self.output.stop_reason
        return "end_turn", None

    def full(self, end: Outcome, kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
        """The whole message. A tool call cut short fails as vLLM's does: its arguments are
        not JSON (a 400 with the decoder's message)."""
        text = self.output.text(end.tokens)
        if self.tool is None:
            content = [{"type": "text", "text": text}]
        else:
            try:
                given = json.loads(text)
            except ValueError as exc:
                raise ApiError(400, sanitize(str(exc))) from None
            content = [
                {"type": "tool_use", "id": self.tool_id, "name": self.tool.name, "input": given}
            ]
        stop_reason, stop_sequence = self.stop(end)
        doc: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.model,
            "stop_reason": stop_reason,
        }
        if stop_sequence is not None:
            doc["stop_sequence"] = stop_sequence
        doc["usage"] = self.usage(end)
        if kv_transfer_params is not None:
            doc["kv_transfer_params"] = kv_transfer_params
        return doc

    # -- the stream

    def opening(self) -> list[bytes]:
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self.usage(None),
        }
        return [named_event("message_start", {"type": "message_start", "message": message})]

    def token(self, event: TokenEvent) -> bytes:
        piece = self.output.piece(event.index)
        if not piece:
            return b""  # the EOS token, or text held back for a stop string
        start = b""
        if not self.started:
            self.started = True
            block: dict[str, Any] = {"type": "text", "text": ""}
            if self.tool is not None:
                block = {
                    "type": "tool_use",
                    "id": self.tool_id,
                    "name": self.tool.name,
                    "input": {},
                }
            start = named_event(
                "content_block_start",
                {"type": "content_block_start", "content_block": block, "index": 0},
            )
        delta = (
            {"type": "text_delta", "text": piece}
            if self.tool is None
            else {"type": "input_json_delta", "partial_json": piece}
        )
        return start + named_event(
            "content_block_delta", {"type": "content_block_delta", "delta": delta, "index": 0}
        )

    def closing(self, end: Outcome) -> list[bytes]:
        parts = []
        if self.started:
            parts.append(
                named_event("content_block_stop", {"type": "content_block_stop", "index": 0})
            )
        stop_reason, stop_sequence = self.stop(end)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        parts.append(
            named_event(
                "message_delta",
                {"type": "message_delta", "delta": delta, "usage": self.usage(end)},
            )
        )
        parts.append(named_event("message_stop", {"type": "message_stop"}))
        return parts

    def failure(self) -> list[bytes]:
        return [STREAM_FAILURE]
