"""Reading a Hugging Face model directory's tokenizer files, as transformers 5 does for vLLM.

``tokenizer.json`` (loaded with ``tokenizers``), the special tokens of
``tokenizer_config.json`` and ``special_tokens_map.json``, the added tokens to add again, and
the chat templates: the tokenizer's and a multimodal processor's. ``HfTokenizer.from_path``
(``hf.py``) puts them together.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from tokenizers import AddedToken, Tokenizer

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
