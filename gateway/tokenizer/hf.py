"""``HfTokenizer``: a Hugging Face fast tokenizer and chat template, applied as vLLM applies them.

Completions prompts are encoded as vLLM 0.32's renderer encodes them. For a chat, the request's
template kwargs are resolved and its template chosen as vLLM's ``HfRenderer`` does, its messages
converted (``messages.py``) and rendered (``chat_template.py``) as transformers 5 does, and
the text encoded. A model directory's files are read by ``hf_load.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal

import jinja2
from tokenizers import AddedToken, Tokenizer

from gateway.tokenizer.chat_template import _render, _Template, _template
from gateway.tokenizer.hf_load import (
    _add_missing_tokens,
    _chat_templates,
    _extra_special_tokens,
    _load_tokenizer_json,
    _processor_template,
    _read_json,
    _special_tokens,
)
from gateway.tokenizer.messages import (
    _developer_to_system,
    _message,
    _reused_prompt_token_ids,
    _tool_dicts,
)
from gateway.tokenizer.protocol import PathKind, _field_bool, _is_token_ids, _refuse


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
