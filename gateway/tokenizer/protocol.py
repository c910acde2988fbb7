"""What a prompt tokenizer is, and how it says no.

``PromptTokenizer`` is the protocol every tokenizer of the package follows, ``PathKind`` the
two request paths it tokenizes. Inside a tokenizer, a request that cannot be tokenized as the
backend would (or that the backend would reject) raises ``_Unfaithful`` (``_refuse``), which
``prompt_tokens`` turns into ``None``; the small body validators here raise it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol

PathKind = Literal["chat", "completions"]


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
