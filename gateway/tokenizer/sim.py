"""``SimTokenizer``: the simulator's prompt ids, for a gateway in front of simulators.

The simulator (``tools/sim``) tokenizes by words, with the word tokenizer of ``words.py``
(which it imports from here: the gateway never imports the simulator); this computes a
request's prompt from its body as the simulator does, with the same functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gateway.tokenizer.protocol import PathKind, _refuse
from gateway.tokenizer.words import render_chat, tokenize


class SimTokenizer:
    """The simulator's prompt ids (``tools/sim/protocol.py``: `_completion_prompt`,
    `_chat_prompt`, `_generation_prompt`), from its word tokenizer (``words.py``).

    Only the prompt is checked: a body the simulator would reject for another field (``n``,
    ``max_tokens``, ...) still gets its prompt's ids, which nobody will cache.
    """

    name: Final = "sim"
    kind: Final = "sim"

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
            return tokenize(prompt)
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
        return tokenize(render_chat(messages, add_generation_prompt=generation_prompt))
