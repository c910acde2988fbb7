"""A request's prompt token ids, computed in the gateway exactly as the backend computes them.

Routing by the KV blocks each vLLM backend holds in its prefix cache (``policies/kv_index.py``)
needs the request's prompt as the token ids the engine will see. One token of difference at
position ``i`` changes the key of every block from ``i`` on, so a close guess is worth nothing:
each tokenizer here either reproduces the backend's ids exactly or answers ``None`` ("cannot
say faithfully"), and the caller falls back to routing without them.

- ``PromptTokenizer``: the protocol. ``prompt_tokens(path_kind, doc)`` never raises on client
  input: a body vLLM would reject, or one this module cannot reproduce (several prompts,
  images or audio, a request-supplied chat template, truncation, ...), gives ``None``.
- ``HfTokenizer``: a Hugging Face model directory (or a bare ``tokenizer.json``), tokenized with
  ``tokenizers`` and chat-rendered with ``jinja2`` the way vLLM 0.32's ``HfRenderer`` does it
  with transformers 5 (both read from ``.venv-vllm``; the comments name each function
  followed). The model's tokenizer must be a fast tokenizer (``tokenizer.json``), as vLLM
  uses for it; Mistral's own format (``tekken.json``) and gpt-oss's Harmony chats are not.
- ``SimTokenizer``: the simulator's word tokenizer, as ``backends/sim/protocol.py`` computes a
  prompt.
- ``load_tokenizer(spec)``: ``"sim"`` or a path, with start-up errors an operator can act on.
- ``Tokenizers``: one tokenizer per model, behind an async ``tokens()`` that tokenizes short
  prompts inline and long ones in a small, bounded thread pool, so a 100k-character prompt
  does not stall the event loop and a flood of them does not queue unbounded work.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from copy import deepcopy
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Final, Literal, Protocol

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

PathKind = Literal["chat", "completions"]
ContentFormat = Literal["string", "openai"]

DEFAULT_INLINE_CHARS: Final = 4_000
"""Prompts up to this many characters are tokenized on the event loop (about a millisecond
at most; most prompts are far shorter and cost less than the ~50 µs hop to a thread).
Longer ones go to the pool: a 100k-character prompt takes ~50 ms, and the encoder releases
the GIL while it runs (loadtest/bench_tokenize.py has the figures)."""

_CHARS_CAP: Final = 1 << 40


class PromptTokenizer(Protocol):
    """Turns a completions or chat completions body into the backend's prompt token ids."""

    @property
    def name(self) -> str:
        """What it was loaded from (a path, or ``sim``), for logs and the admin API."""
        ...

    @property
    def kind(self) -> str:
        """``hf`` or ``sim``."""
        ...

    def prompt_tokens(self, path_kind: PathKind, doc: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids, or None when they cannot be computed faithfully.

        Never raises on client input; ``doc`` (the parsed JSON body) is not modified.
        """
        ...


class _Unfaithful(Exception):
    """Internal: this request cannot be tokenized as the backend would (or it would reject it)."""


def _refuse(why: str) -> _Unfaithful:
    return _Unfaithful(why)


# --------------------------------------------------------------------------------------------
# Small validators: vLLM validates bodies with pydantic; anything it would coerce or reject is
# refused here rather than guessed at.


def _field_bool(doc: Mapping[str, Any], key: str, default: bool) -> bool:
    if key not in doc:
        return default
    value = doc[key]
    if not isinstance(value, bool):
        raise _refuse(f"{key} is not a boolean")
    return value


def _is_token_ids(value: Any) -> bool:
    # vllm/entrypoints/openai/completion/protocol.py: list[Annotated[int, Field(ge=0)]]; bool
    # is an int subclass that pydantic would coerce, so it is refused.
    return (
        isinstance(value, list) and len(value) > 0 and all(type(t) is int and t >= 0 for t in value)
    )


# --------------------------------------------------------------------------------------------
# Jinja, as transformers compiles chat templates: utils/chat_template_utils.py
# `_compiled_jinja_template` (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, the
# `{% generation %}` tag and loopcontrols; `tojson` without HTML escaping; `raise_exception`;
# `strftime_now`).


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' AssistantTracker, which only
    records where assistant text is when asked for an assistant mask; rendering is the body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's Extension declares it so)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_generation_support")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _generation_support(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass(frozen=True, slots=True)
class _Template:
    """A chat template compiled once, with what vLLM derives from its source."""

    source: str
    compiled: jinja2.Template
    variables: frozenset[str]  # undeclared variables: what chat_template_kwargs may set
    content_format: ContentFormat  # detected, as vLLM's "auto"
    mentions_developer: bool


@lru_cache(maxsize=32)
def _template(source: str) -> _Template:
    """Compile ``source``; ``jinja2.TemplateSyntaxError`` if it does not parse."""
    env = _environment()
    compiled = env.from_string(source)
    ast = env.parse(source)
    return _Template(
        source=source,
        compiled=compiled,
        # vllm/renderers/hf.py `_resolve_chat_template_kwargs`
        variables=frozenset(jinja2.meta.find_undeclared_variables(ast)),
        content_format=_detect_content_format(ast),
        # vllm/renderers/hf.py `_detect_developer_role_support`
        mentions_developer='"developer"' in source or "'developer'" in source,
    )


# --- Content format: vllm/renderers/hf.py `_detect_content_format` and the AST walkers it uses
# (`_is_var_access`, `_is_attr_access`, `_is_var_or_elems_access`,
# `_iter_nodes_assign_var_or_elems`, `_iter_nodes_assign_messages_item`,
# `_iter_nodes_assign_content_item`): a template that loops over a message's content gets the
# content as OpenAI parts ("openai"), any other gets it as one string ("string").


def _is_var_access(node: jinja2.nodes.Node, varname: str) -> bool:
    if isinstance(node, jinja2.nodes.Name):
        return bool(node.ctx == "load" and node.name == varname)
    return False


def _is_attr_access(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var_access(node.node, varname)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: jinja2.nodes.Node, varname: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _name_of(node: jinja2.nodes.Node) -> str:
    # vLLM asserts this; an assertion error there makes the detection fall back to "string".
    if not isinstance(node, jinja2.nodes.Name):
        raise ValueError("not a plain name")
    return str(node.name)


def _iter_assign_var_or_elems(
    root: jinja2.nodes.Node, varname: str
) -> Iterator[tuple[jinja2.nodes.Node, str]]:
    yield root, varname
    related = deque([varname])
    seen = {varname}  # vLLM guards self-assignment only; a cycle of two would never end
    while related:
        related_name = related.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems_access(assign.node, related_name):
                lhs = _name_of(assign.target)
                yield assign, lhs
                if lhs not in seen:
                    seen.add(lhs)
                    related.append(lhs)


def _iter_messages_item(root: jinja2.nodes.Node) -> Iterator[tuple[jinja2.nodes.Node, str]]:
    names = [name for _, name in _iter_assign_var_or_elems(root, "messages")]
    for loop in root.find_all(jinja2.nodes.For):
        for name in names:
            if _is_var_or_elems_access(loop.iter, name):
                yield loop, _name_of(loop.target)
                break


def _macro_content_params(
    root: jinja2.nodes.Node, message_names: list[str]
) -> tuple[dict[int, set[str]], set[int]]:
    """Macro parameters that receive message.content, whatever they are called, per loop of
    the macro's body; and the ids of every loop inside a macro."""
    params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()

    def is_content(node: jinja2.nodes.Node) -> bool:
        return any(_is_var_or_elems_access(node, name, "content") for name in message_names)

    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and is_content(arg):
                    content_params.add(macro.args[i].name)
            for kwarg in call.kwargs:
                if (
                    isinstance(kwarg, jinja2.nodes.Keyword)
                    and kwarg.key in param_names
                    and is_content(kwarg.value)
                ):
                    content_params.add(kwarg.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                params_by_loop[id(loop)] = content_params
    return params_by_loop, loops_in_macros


def _iter_content_item(root: jinja2.nodes.Node) -> Iterator[tuple[jinja2.nodes.Node, str]]:
    message_names = [name for _, name in _iter_messages_item(root)]
    params_by_loop, loops_in_macros = _macro_content_params(root, message_names)
    for loop in root.find_all(jinja2.nodes.For):
        it = loop.iter
        if any(_is_var_or_elems_access(it, name, "content") for name in message_names):
            yield loop, _name_of(loop.target)
            continue
        params = params_by_loop.get(id(loop))
        if isinstance(it, jinja2.nodes.Name) and params is not None and it.name in params:
            yield loop, _name_of(loop.target)
            continue
        if (
            id(loop) not in loops_in_macros
            and isinstance(it, jinja2.nodes.Name)
            and it.name == "content"
        ):
            yield loop, _name_of(loop.target)


def _detect_content_format(ast: jinja2.nodes.Template) -> ContentFormat:
    try:
        next(_iter_content_item(ast))
    except StopIteration:
        return "string"
    except Exception:
        return "string"  # vLLM: the default it was given, "string"
    return "openai"


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


def _merge(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """vllm/renderers/params.py `merge_kwargs`: overrides win unless they are None or "auto"."""
    return {
        **defaults,
        **{
            k: v
            for k, v in overrides.items()
            if not (v is None or (isinstance(v, str) and v == "auto"))
        },
    }


_REASONING_EFFORTS: Final = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
# The parameters of transformers' `apply_chat_template` (vllm/renderers/hf.py
# `_get_hf_base_chat_template_params` reads them from its signature, `self` included): always
# accepted from chat_template_kwargs, whether or not the template uses them.
# fmt: off
_APPLY_PARAMS: Final = frozenset({
    "self", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})
# fmt: on
_CONTINUE_TAG: Final = "CONTINUE_FINAL_MESSAGE_TAG "


def _render(
    template: _Template,
    conversation: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    documents: Any,
    add_generation_prompt: Any,
    continue_final_message: Any,
    variables: Mapping[str, Any],
) -> str:
    """transformers utils/chat_template_utils.py `render_jinja_template`, for one conversation."""
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise _refuse("documents must be objects")
    chat = conversation
    final_message: str | None = None
    if continue_final_message:
        chat = deepcopy(conversation)
        final = chat[-1].get("content")
        if final is None or "content" not in template.source:
            raise _refuse("continue_final_message without content to continue")
        if isinstance(final, list):
            for block in reversed(final):
                if "text" in block:
                    final_message = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise _refuse("continue_final_message: no text in the final message")
        else:
            final_message = final
            chat[-1]["content"] = final + _CONTINUE_TAG
    rendered = template.compiled.render(
        messages=chat,
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
    if final_message is not None:
        tag = _CONTINUE_TAG.strip()
        if final_message.strip() not in rendered or tag not in rendered:
            raise _refuse("the template drops part of the final message")
        at = rendered.rindex(tag)
        if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            rendered = rendered[:at]
        else:
            rendered = rendered[:at].rstrip()
    return rendered


# --------------------------------------------------------------------------------------------
# Loading a model directory as transformers 5's AutoTokenizer does for vLLM
# (tokenization_utils_base.py `from_pretrained` / `_from_pretrained`,
# tokenization_utils_tokenizers.py `TokenizersBackend.__init__`).

_SPECIAL_ATTRS: Final = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_ADDED_TOKEN_FIELDS: Final = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _added_token(value: Any, *, special: bool | None = None) -> AddedToken | None:
    """A token from tokenizer_config: a string, or a serialized AddedToken (a dict)."""
    if isinstance(value, str):
        return (
            AddedToken(value, special=True)
            if special is None
            else AddedToken(value, special=special)
        )
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        kwargs = {k: value[k] for k in _ADDED_TOKEN_FIELDS if k in value and k != "content"}
        if special is not None:
            kwargs["special"] = special
        return AddedToken(value["content"], **kwargs)
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"tokenizer: {path} is not a JSON object")
    return data


def _special_tokens(
    config: Mapping[str, Any], special_map: Mapping[str, Any] | None
) -> dict[str, AddedToken]:
    """The named special tokens (bos_token, ...), and the model-specific ``*_token`` strings,
    as ``special_tokens_map`` gives them to the template. ``special_tokens_map.json`` counts
    only when tokenizer_config has no ``added_tokens_decoder`` (the legacy layout)."""
    merged = dict(config)
    if special_map is not None and "added_tokens_decoder" not in config:
        merged.update(special_map)
    tokens: dict[str, AddedToken] = {}
    for key in _SPECIAL_ATTRS:
        value = merged.get(key)
        if value is None:
            continue
        token = _added_token(value, special=True)
        if token is None:
            raise ValueError(f"special token {key} is neither a string nor an AddedToken")
        tokens[key] = token
    for key, value in config.items():
        if key not in _SPECIAL_ATTRS and key.endswith("_token") and isinstance(value, str):
            tokens[key] = AddedToken(value, special=True)
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        for key, value in extra.items():
            token = _added_token(value, special=True)
            if token is not None:
                tokens[str(key)] = token
    return tokens


def _extra_special_tokens(
    config: Mapping[str, Any], special_map: Mapping[str, Any] | None
) -> list[AddedToken]:
    """The unnamed special tokens (``extra_special_tokens``, formerly
    ``additional_special_tokens``): not template variables, but added to the tokenizer when
    missing, so the text's copies of them are matched whole."""
    values: list[Any] = []
    for source in (config, special_map or {}):
        for key in ("extra_special_tokens", "additional_special_tokens"):
            listed = source.get(key)
            if isinstance(listed, list):
                values.extend(listed)
    return [t for t in (_added_token(v, special=True) for v in values) if t is not None]


def _add_missing_tokens(
    tok: Tokenizer, config: Mapping[str, Any], specials: Sequence[AddedToken]
) -> None:
    """TokenizersBackend.__init__: tokenizer_config's added tokens that differ from
    tokenizer.json's are added again (their flags win), then any special token not yet an
    added token is added as a special one."""
    present = tok.get_added_tokens_decoder()
    reprs = {repr(t) for t in present.values()}
    to_add: list[AddedToken] = []
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        entries = []
        for idx, value in decoder.items():
            token = (
                _added_token(value, special=bool(value.get("special", False)))
                if isinstance(value, dict)
                else None
            )
            if token is None or not str(idx).isdigit():
                raise ValueError("added_tokens_decoder holds an entry that is not an AddedToken")
            entries.append((int(idx), token))
        to_add = [t for _, t in sorted(entries, key=lambda e: e[0]) if repr(t) not in reprs]
    known = {t.content for t in present.values()} | {t.content for t in to_add}
    for token in specials:
        if token.content not in known:
            to_add.append(token)
            known.add(token.content)
    if to_add:
        tok.add_tokens(to_add)


def _chat_templates(directory: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The tokenizer's chat template(s): chat_template.jinja and additional_chat_templates/*.jinja
    take priority over tokenizer_config["chat_template"] (a string, or a list of named ones)."""
    files: dict[str, str] = {}
    main = directory / "chat_template.jinja"
    if main.is_file():
        files["default"] = main.read_text(encoding="utf-8")
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if len(files) == 1 and "default" in files:
        return files["default"]
    if files:
        return files
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named: dict[str, str] = {}
        for entry in value:
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise ValueError("chat_template is a list whose entries are not {name, template}")
            named[entry["name"]] = entry["template"]
        return named
    raise ValueError("chat_template is neither a string nor a list of named templates")


def _processor_template(directory: Path) -> str | None:
    """A multimodal model's processor template, which vLLM prefers to the tokenizer's when the
    request has no tools (vllm/renderers/hf.py `resolve_chat_template`, 2nd priority). Only
    directories with a processor config have one; its legacy file is chat_template.json."""
    if not any(
        (directory / n).is_file() for n in ("processor_config.json", "preprocessor_config.json")
    ):
        return None
    main = directory / "chat_template.jinja"
    if main.is_file():
        return main.read_text(encoding="utf-8")
    legacy = directory / "chat_template.json"
    if legacy.is_file():
        value = _read_json(legacy).get("chat_template")
        return value if isinstance(value, str) else None
    return None


class HfTokenizer:
    """A Hugging Face fast tokenizer and chat template, applied as vLLM applies them.

    Completions: a string prompt is encoded with ``add_special_tokens`` (default true, so the
    tokenizer's post-processor adds BOS where the model has one); token ids are used as they
    are; a one-element list is its element. Chat: the messages are parsed as vLLM parses them
    (text parts joined with newlines, or kept as parts when the template loops over content),
    rendered with the template, and the text encoded with ``add_special_tokens`` false (the
    template writes BOS itself). ``server_chat_template``, ``default_chat_template_kwargs``
    and ``content_format`` mirror vLLM's ``--chat-template``, ``--default-chat-template-kwargs``
    and ``--chat-template-content-format`` server options, for fleets started with them.
    """

    kind: Final = "hf"

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        name: str,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        processor_chat_template: str | None = None,
        server_chat_template: str | None = None,
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
        content_format: Literal["auto", "string", "openai"] = "auto",
        chat: bool = True,
    ) -> None:
        self.name = name
        self._tok = tokenizer
        self._special = dict(special_tokens or {})
        self._templates: str | dict[str, str] | None = (
            chat_template
            if chat_template is None or isinstance(chat_template, str)
            else dict(chat_template)
        )
        self._processor_template = processor_chat_template
        self._server_template = server_chat_template
        self._default_kwargs = dict(default_chat_template_kwargs or {})
        self._content_format = content_format
        self._chat = chat
        for source in self._template_sources():
            _template(source)  # a syntax error shows at start-up, not per request

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        *,
        server_chat_template: str | None = None,
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
        content_format: Literal["auto", "string", "openai"] = "auto",
    ) -> HfTokenizer:
        """Load a model directory (tokenizer.json, tokenizer_config.json, the chat template)
        or a bare tokenizer.json (completions only: no template, no special-token names).

        ``ValueError`` names the path and what is wrong with it.
        """
        p = Path(path).expanduser()
        if p.is_dir():
            return cls._from_directory(
                p,
                server_chat_template=server_chat_template,
                default_chat_template_kwargs=default_chat_template_kwargs,
                content_format=content_format,
            )
        if p.is_file():
            tok, _ = _load_tokenizer_json(p)
            return cls(
                tok,
                name=str(p),
                server_chat_template=server_chat_template,
                default_chat_template_kwargs=default_chat_template_kwargs,
                content_format=content_format,
            )
        raise ValueError(
            f"tokenizer {str(path)!r}: no such file or directory (expected 'sim', a model "
            "directory with tokenizer.json, or the path of a tokenizer.json)"
        )

    @classmethod
    def _from_directory(
        cls,
        directory: Path,
        *,
        server_chat_template: str | None,
        default_chat_template_kwargs: Mapping[str, Any] | None,
        content_format: Literal["auto", "string", "openai"],
    ) -> HfTokenizer:
        tokenizer_json = directory / "tokenizer.json"
        if any(directory.glob("consolidated*.safetensors")) and (
            (directory / "tekken.json").is_file() or any(directory.glob("tokenizer.model.v*"))
        ):
            # vllm/tokenizers/registry.py `resolve_tokenizer_args`: tokenizer_mode "auto" picks
            # mistral_common for such a directory, whose ids tokenizer.json does not give.
            raise ValueError(
                f"tokenizer {directory}: a Mistral-format model (consolidated weights and "
                "tekken.json / tokenizer.model.v*): vLLM tokenizes it with mistral_common, "
                "which the gateway does not reproduce"
            )
        if not tokenizer_json.is_file():
            others = [
                n
                for n in ("tokenizer.model", "tekken.json", "vocab.json")
                if (directory / n).is_file()
            ]
            found = (
                f" (found {', '.join(others)}: only fast tokenizers are supported)"
                if others
                else ""
            )
            raise ValueError(f"tokenizer {directory}: no tokenizer.json in the directory{found}")
        config_path = directory / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        special_map_path = directory / "special_tokens_map.json"
        special_map = _read_json(special_map_path) if special_map_path.is_file() else None
        tok, pad_token = _load_tokenizer_json(tokenizer_json)
        try:
            specials = _special_tokens(config, special_map)
            if "pad_token" not in specials and pad_token is not None:
                # TokenizersBackend: the padding tokenizer.json configures names the pad token.
                specials["pad_token"] = AddedToken(pad_token, special=True)
            extra = _extra_special_tokens(config, special_map)
            _add_missing_tokens(tok, config, [*specials.values(), *extra])
            templates = _chat_templates(directory, config)
            processor = _processor_template(directory)
        except (ValueError, TypeError, OSError) as exc:
            raise ValueError(f"tokenizer {directory}: {exc}") from None
        # TokenizersBackend: split_special_tokens (default false) decides whether special
        # tokens written in the text are matched as such.
        tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
        model_type = None
        model_config = directory / "config.json"
        if model_config.is_file():
            model_type = _read_json(model_config).get("model_type")
        try:
            return cls(
                tok,
                name=str(directory),
                special_tokens={k: t.content for k, t in specials.items()},
                chat_template=templates,
                processor_chat_template=processor,
                server_chat_template=server_chat_template,
                default_chat_template_kwargs=default_chat_template_kwargs,
                content_format=content_format,
                # vllm/renderers/online_renderer.py: gpt-oss chats go through Harmony.
                chat=model_type != "gpt_oss",
            )
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(
                f"tokenizer {directory}: the chat template does not parse: {exc}"
            ) from None

    # ---- reporting

    @property
    def has_chat_template(self) -> bool:
        return self._chat and bool(
            self._templates or self._server_template or self._processor_template
        )

    def _template_sources(self) -> list[str]:
        sources = [self._server_template, self._processor_template]
        if isinstance(self._templates, dict):
            sources.extend(self._templates.values())
        else:
            sources.append(self._templates)
        return [s for s in sources if s is not None]

    # ---- tokenizing

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """``text``'s ids, as transformers' ``tokenizer(text, add_special_tokens=...)``."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def prompt_tokens(self, path_kind: PathKind, doc: Mapping[str, Any]) -> list[int] | None:
        try:
            ids = self._chat_ids(doc) if path_kind == "chat" else self._completion_ids(doc)
        except Exception:  # _Unfaithful, or a template error on this request's data
            return None
        return ids or None

    def _completion_ids(self, doc: Mapping[str, Any]) -> list[int]:
        # vllm/renderers/online_renderer.py `render_completion` / `preprocess_completion`,
        # vllm/renderers/inputs/preprocess.py `prompt_to_seq` / `parse_dec_only_prompt`,
        # vllm/renderers/base.py `_tokenize_singleton_prompt` with CompletionRequest's
        # TokenizeParams (add_special_tokens defaults to true).
        if doc.get("suffix") is not None or doc.get("prompt_embeds") is not None:
            raise _refuse("suffix or prompt_embeds")
        if doc.get("truncate_prompt_tokens") is not None:
            raise _refuse("truncate_prompt_tokens")
        add_special = _field_bool(doc, "add_special_tokens", True)
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=add_special)
        if isinstance(prompt, list) and _is_token_ids(prompt):
            return list(prompt)
        raise _refuse("not one prompt")

    def _chat_ids(self, doc: Mapping[str, Any]) -> list[int]:
        if not self._chat:
            raise _refuse("chats of this model are not rendered with its template")
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _refuse("no messages")
        reused = _reused_prompt_token_ids(doc)
        if reused is not None:
            return reused
        kwargs = self._chat_template_kwargs(doc)
        add_special = _field_bool(doc, "add_special_tokens", False)
        text, tokenized = self._apply_chat_template(messages, kwargs)
        if tokenized:
            # Tokenized inside apply_chat_template (a request's chat_template_kwargs asked for
            # it), without special tokens; the renderer then uses those ids as they are.
            return self.encode(text, add_special_tokens=False)
        # vllm/renderers/base.py `_tokenize_prompt` with ChatCompletionRequest.build_tok_params.
        return self.encode(text, add_special_tokens=add_special)

    def _chat_template_kwargs(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """The kwargs vLLM hands `safe_apply_chat_template`.

        vllm/entrypoints/openai/chat_completion/protocol.py ChatCompletionRequest (its fields,
        `check_generation_prompt`, `build_chat_params`), then online_renderer.py
        `preprocess_chat` (`with_defaults`: tools and tokenize=False under the request's
        kwargs) and ChatParams.get_apply_chat_template_kwargs. `validate_chat_template`
        refuses a request's own template (that needs --trust-request-chat-template).
        """
        add_generation_prompt = _field_bool(doc, "add_generation_prompt", True)
        continue_final = _field_bool(doc, "continue_final_message", False)
        if add_generation_prompt and continue_final:
            raise _refuse("both add_generation_prompt and continue_final_message")
        if doc.get("chat_template") is not None or doc.get("truncate_prompt_tokens") is not None:
            raise _refuse("a request chat template, or truncation")
        user_kwargs = doc.get("chat_template_kwargs")
        if user_kwargs is None:
            user_kwargs = {}
        if not isinstance(user_kwargs, dict) or user_kwargs.get("chat_template") is not None:
            raise _refuse("chat_template_kwargs")
        documents = doc.get("documents")
        if documents is not None and not (
            isinstance(documents, list)
            and all(
                isinstance(d, dict) and all(isinstance(v, str) for v in d.values())
                for d in documents
            )
        ):
            raise _refuse("documents is not a list of string maps")
        effort = doc.get("reasoning_effort")
        if effort is not None and not (isinstance(effort, str) and effort in _REASONING_EFFORTS):
            raise _refuse("reasoning_effort")
        tools = _tool_dicts(doc.get("tools"))
        extra: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final,
            "documents": documents,
            "reasoning_effort": effort,
        }
        if effort is not None and "enable_thinking" not in user_kwargs:
            extra["enable_thinking"] = effort != "none"
        kwargs = _merge(user_kwargs, extra)
        kwargs = _merge(_merge(self._default_kwargs, {"tools": tools, "tokenize": False}), kwargs)
        return _merge(kwargs, {"return_dict": False})

    def _apply_chat_template(self, messages: list[Any], kwargs: dict[str, Any]) -> tuple[str, bool]:
        """(rendered text, whether apply_chat_template tokenizes it itself).

        vllm/renderers/hf.py `render_messages` (`parse_chat_messages` with the resolved
        content format) and `safe_apply_chat_template` (developer role, the kwargs the
        template accepts), then transformers tokenization_utils_base.py `apply_chat_template`.
        """
        kwargs = dict(kwargs)
        tools = kwargs.pop("tools", None)
        tokenize = kwargs.pop("tokenize", True)
        template = self._resolve_template(tools is not None)
        fmt = template.content_format if self._content_format == "auto" else self._content_format
        conversation = [_message(m, fmt) for m in messages]
        if not template.mentions_developer and any(m["role"] == "developer" for m in conversation):
            conversation = _developer_to_system(conversation)
        # `resolve_chat_template_kwargs`: what the template reads, or apply_chat_template takes.
        accepted = (template.variables | _APPLY_PARAMS) - {"chat_template", "tokenize"}
        resolved = {k: v for k, v in kwargs.items() if k in accepted}

        # apply_chat_template(conversation=..., tools=..., chat_template=..., tokenize=...,
        # **resolved): its named parameters come out, the rest go to the template.
        if "self" in resolved or "conversation" in resolved:
            raise _refuse("a kwarg that clashes with apply_chat_template's parameters")
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise _refuse("tools must be objects")
        documents = resolved.pop("documents", None)
        agp = resolved.pop("add_generation_prompt", False)
        cfm = resolved.pop("continue_final_message", False)
        options = [
            resolved.pop(k)
            for k in ("padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs")
            if k in resolved
        ]
        return_dict = resolved.pop("return_dict", True)
        if resolved.pop("return_assistant_tokens_mask", False) and not (return_dict and tokenize):
            raise _refuse("return_assistant_tokens_mask")
        if cfm and agp:
            raise _refuse("both add_generation_prompt and continue_final_message")
        if "messages" in resolved or "conversations" in resolved:
            raise _refuse("a kwarg that clashes with the template's own variables")
        if tokenize and options:
            raise _refuse("tokenizer options in chat_template_kwargs")
        text = _render(
            template,
            conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=agp,
            continue_final_message=cfm,
            variables={**self._special, **resolved},
        )
        return text, bool(tokenize)

    def _resolve_template(self, with_tools: bool) -> _Template:
        """vllm/renderers/hf.py `resolve_chat_template`: the server's --chat-template, else the
        processor's template (requests without tools), else the tokenizer's (a "tool_use" one
        for requests with tools, else "default"). vLLM's last resort, a built-in template per
        model type, is not reproduced: no template means None."""
        templates = self._templates
        source: str | None = None
        if self._server_template is not None:
            source = self._server_template
            if isinstance(templates, dict) and source in templates:
                source = templates[source]  # a template's name
        elif not with_tools and self._processor_template is not None:
            source = self._processor_template
        elif isinstance(templates, dict):
            if with_tools and "tool_use" in templates:
                source = templates["tool_use"]
            else:
                source = templates.get("default")
        else:
            source = templates
        if source is None:
            raise _refuse("no chat template")
        return _template(source)


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


def _load_tokenizer_json(path: Path) -> tuple[Tokenizer, str | None]:
    """The tokenizer, and the pad token its padding settings name (if any)."""
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception
        raise ValueError(f"tokenizer {path}: not a tokenizers tokenizer.json ({exc})") from None
    padding = tok.padding
    pad_token = padding.get("pad_token") if padding else None
    # transformers sets truncation and padding per call; for one prompt within the model's
    # context, neither applies.
    tok.no_truncation()
    tok.no_padding()
    return tok, pad_token if isinstance(pad_token, str) else None


# --------------------------------------------------------------------------------------------


class SimTokenizer:
    """The simulator's prompt ids (``backends/sim/protocol.py``: `_completion_prompt`,
    `_chat_prompt`, `_generation_prompt`), from its word tokenizer (``backends/sim/tokens.py``).

    Only the prompt is checked: a body the simulator would reject for another field (``n``,
    ``max_tokens``, ...) still gets its prompt's ids, which nobody will cache.
    """

    name: Final = "sim"
    kind: Final = "sim"

    def __init__(self) -> None:
        from backends.sim import tokens  # the simulator package, only when asked for

        self._tokenize = tokens.tokenize
        self._render_chat = tokens.render_chat

    def prompt_tokens(self, path_kind: PathKind, doc: Mapping[str, Any]) -> list[int] | None:
        try:
            ids = self._chat(doc) if path_kind == "chat" else self._completion(doc)
        except Exception:
            return None
        return ids or None

    def _completion(self, doc: Mapping[str, Any]) -> list[int]:
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._tokenize(prompt)
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return list(prompt)
        raise _refuse("not one prompt")

    def _chat(self, doc: Mapping[str, Any]) -> list[int]:
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _refuse("no messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _refuse("a message without a role")
            content = m.get("content")
            if content is not None and not isinstance(content, str | list):
                raise _refuse("content is neither a string nor a list")
        add = doc.get("add_generation_prompt")
        cont = doc.get("continue_final_message")
        if (add is not None and not isinstance(add, bool)) or (
            cont is not None and not isinstance(cont, bool)
        ):
            raise _refuse("not a boolean")
        if cont:
            if add:
                raise _refuse("both add_generation_prompt and continue_final_message")
            generation_prompt = False
        else:
            generation_prompt = add is not False
        return self._tokenize(self._render_chat(messages, add_generation_prompt=generation_prompt))


def load_tokenizer(spec: str) -> PromptTokenizer:
    """``"sim"``: the simulator's tokenizer; otherwise a model directory or a tokenizer.json.

    ``ValueError`` (shown to operators at start-up) names the path and what is missing.
    """
    if spec == "sim":
        return SimTokenizer()
    if not spec.strip():
        raise ValueError("tokenizer: empty spec (expected 'sim' or a path)")
    return HfTokenizer.from_path(spec)


# --------------------------------------------------------------------------------------------


def prompt_chars(path_kind: PathKind, doc: Mapping[str, Any], limit: int = _CHARS_CAP) -> int:
    """How much text tokenizing ``doc`` means, in characters (token ids and other numbers
    count one each). Counting stops once past ``limit``, so deciding where to tokenize a
    100k-id prompt costs no more than deciding for a short one. Never raises."""
    if not isinstance(doc, Mapping):
        return 0
    keys = (
        ("messages", "tools", "documents", "chat_template_kwargs")
        if path_kind == "chat"
        else ("prompt",)
    )
    total = 0
    stack: list[tuple[Any, int]] = [(doc.get(k), 0) for k in keys]
    while stack and total <= limit:
        value, depth = stack.pop()
        items = value.values() if isinstance(value, dict) else value
        if not isinstance(value, list | dict):
            items = (value,)
        for item in items:
            if isinstance(item, str):
                total += len(item)
            elif isinstance(item, int | float):
                total += 1
            elif depth < 16 and isinstance(item, list | dict):
                stack.append((item, depth + 1))
            if total > limit:
                break
    return total


@dataclass(slots=True)
class TokenizerStats:
    """What ``Tokenizers.tokens`` did, for metrics: where each prompt was tokenized, and the
    ones turned away."""

    inline: int = 0
    offloaded: int = 0
    busy: int = 0  # a long prompt found the pool full: None, the caller falls back
    no_tokenizer: int = 0  # a model without a tokenizer
    failed: int = 0  # a tokenizer raised (prompt_tokens must not: a bug)


class Tokenizers:
    """One ``PromptTokenizer`` per model name, tokenizing without stalling the event loop.

    A prompt of up to ``inline_chars`` characters is tokenized inline: cheaper than a thread
    hop. A longer one goes to a thread pool of ``threads`` owned here, with at most
    ``max_pending`` prompts running or waiting; past that, ``tokens`` answers None at once
    (``stats.busy``) rather than queue work no request will wait for. ``close()`` shuts the
    pool down. ``doc`` must not be modified while ``tokens`` runs.
    """

    def __init__(
        self,
        by_model: Mapping[str, PromptTokenizer],
        *,
        inline_chars: int = DEFAULT_INLINE_CHARS,
        threads: int = 1,
        max_pending: int = 4,
    ) -> None:
        if threads < 1 or max_pending < 1:
            raise ValueError("threads and max_pending must be at least 1")
        self._by_model = dict(by_model)
        self.inline_chars = inline_chars
        self.max_pending = max_pending
        self.stats = TokenizerStats()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")
        self._lock = threading.Lock()  # guards _pending and stats.failed (pool threads)
        self._pending = 0
        self._closed = False

    @classmethod
    def load(cls, specs: Mapping[str, str], **options: Any) -> Tokenizers:
        """``{model: spec}`` through ``load_tokenizer``; the first bad spec raises ValueError."""
        return cls({model: load_tokenizer(spec) for model, spec in specs.items()}, **options)

    def get(self, model: str) -> PromptTokenizer | None:
        return self._by_model.get(model)

    @property
    def models(self) -> dict[str, PromptTokenizer]:
        return dict(self._by_model)

    async def tokens(
        self, model: str, path_kind: PathKind, doc: Mapping[str, Any]
    ) -> list[int] | None:
        """The prompt's token ids, or None (no tokenizer, not faithful, pool full, closed)."""
        tokenizer = self._by_model.get(model)
        if tokenizer is None:
            self.stats.no_tokenizer += 1
            return None
        if self._closed:
            return None
        if prompt_chars(path_kind, doc, self.inline_chars) <= self.inline_chars:
            self.stats.inline += 1
            return self._run(tokenizer, path_kind, doc)
        with self._lock:
            full = self._pending >= self.max_pending
            if not full:
                self._pending += 1
        if full:
            self.stats.busy += 1
            return None
        try:
            future: Future[list[int] | None] = self._pool.submit(
                self._run, tokenizer, path_kind, doc
            )
        except RuntimeError:  # shut down meanwhile
            self._done(None)
            return None
        # The slot is freed when the work ends or is cancelled, not when the caller stops
        # waiting: a caller that gave up does not make room while its prompt still runs.
        future.add_done_callback(self._done)
        self.stats.offloaded += 1
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # close() dropped the queued work: the caller gets None, not a cancellation of
            # its own task (which it would take for a client gone away).
            task = asyncio.current_task()
            if future.cancelled() and (task is None or task.cancelling() == 0):
                return None
            raise

    @property
    def pending(self) -> int:
        """Long prompts running or waiting in the pool."""
        return self._pending

    def _done(self, _future: Future[list[int] | None] | None) -> None:
        with self._lock:
            self._pending -= 1

    def _run(
        self, tokenizer: PromptTokenizer, path_kind: PathKind, doc: Mapping[str, Any]
    ) -> list[int] | None:
        try:
            return tokenizer.prompt_tokens(path_kind, doc)
        except Exception:
            with self._lock:
                self.stats.failed += 1
            return None

    def close(self) -> None:
        """Stop the pool: queued prompts are dropped (their callers get None), running ones
        finish in their thread."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
