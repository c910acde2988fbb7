"""The request's routing facts, computed for one policy's ``Needs`` and nothing more. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from policies.types import Needs, RouteFacts


def route_facts(
    needs: Needs,
    model: str,
    doc: Mapping[str, Any],
    headers: Mapping[str, str],
    tokens: Sequence[int] | None = None,
) -> RouteFacts:
    """What ``needs`` asks for of a request body ``doc`` (already a JSON object) for ``model``.

    Prefix hashes cost a walk over the prompt's first blocks; a policy that does not ask for
    them (every policy but ``prefix_affinity`` and ``precise_prefix``) does not pay it.
    ``tokens`` (the prompt's token ids) are computed by the caller, off the event loop when
    long, and only for a policy whose ``Needs.tokens`` asks for them.
    """
    hashes: tuple[int, ...] = ()
    key = None
    if needs.prefix is not None:
        hashes, key = needs.prefix.facts(model, doc, keyed=needs.prefix_key)
    session = headers.get(needs.session_header) if needs.session_header else None
    prompt = tuple(tokens) if needs.tokens and tokens is not None else None
    return RouteFacts(
        model=model, session_key=session, prefix_hashes=hashes, prefix_key=key, prompt_tokens=prompt
    )
