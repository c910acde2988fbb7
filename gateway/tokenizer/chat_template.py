"""Chat templates, compiled and rendered as transformers does it for vLLM.

The Jinja environment transformers compiles templates in; ``_template``, a template compiled
once with what vLLM derives from its source (the variables ``chat_template_kwargs`` may set,
the content format vLLM's ``"auto"`` detects, whether it knows the developer role); and
``_render``, which renders one conversation with it (``continue_final_message`` included).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from copy import deepcopy
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Final, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.tokenizer.protocol import _refuse

ContentFormat = Literal["string", "openai"]


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
# Rendering one conversation: transformers utils/chat_template_utils.py `render_jinja_template`.

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
