"""The request's routing facts, computed for one policy's ``Needs`` and nothing more. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from policies.types import Needs, RouteFacts

# About how many characters of text make a token (English, BPE tokenizers); for estimates only.
CHARS_PER_TOKEN = 4.0


def route_facts(
    needs: Needs,
    model: str,
    doc: Mapping[str, Any],
    headers: Mapping[str, str],
    tokens: Sequence[int] | None = None,
    *,
    objective: str | None = None,
    size: bool = False,
) -> RouteFacts:
    """What ``needs`` asks for of a request body ``doc`` (already a JSON object) for ``model``.

    Prefix hashes cost a walk over the prompt's first blocks; a policy that does not ask for
    them (every policy but ``prefix_affinity`` and ``precise_prefix``) does not pay it.
    ``tokens`` (the prompt's token ids) are computed by the caller, off the event loop when
    long, and only for a policy whose ``Needs.tokens`` asks for them. ``size``: the prompt's
    size and the answer's budget even if ``needs`` does not ask (the latency tracker learns
    from them under every policy). ``objective``: the caller's, for ``predicted_latency``.
    """
    hashes: tuple[int, ...] = ()
    key = None
    if needs.prefix is not None:
        hashes, key = needs.prefix.facts(model, doc, keyed=needs.prefix_key)
    session = headers.get(needs.session_header) if needs.session_header else None
    prompt = tuple(tokens) if needs.tokens and tokens is not None else None
    chars, budget = (prompt_chars(doc), max_tokens(doc)) if needs.size or size else (0, None)
    return RouteFacts(
        model=model,
        session_key=session,
        prefix_hashes=hashes,
        prefix_key=key,
        prompt_tokens=prompt,
        prompt_chars=chars,
        max_tokens=budget,
        objective=objective,
    )


def prompt_chars(doc: Mapping[str, Any]) -> int:
    """The prompt's size in characters: a chat's message texts, a completion's prompt (its
    first, for a batch); a token-id prompt counts four characters per id. O(messages)."""
    messages = doc.get("messages")
    if isinstance(messages, list):
        n = 0
        for m in messages:
            if isinstance(m, dict):
                n += _content_chars(m.get("content"))
        return n
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return 4 * len(prompt)
    return 0


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            len(part["text"])
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return 0


def max_tokens(doc: Mapping[str, Any]) -> int | None:
    """The answer's token budget the request gives, if a positive integer."""
    for name in ("max_completion_tokens", "max_tokens"):
        v = doc.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None
