"""The word tokenizer the simulator (``tools/sim``) serves: simple, deterministic, stable
across processes. It lives here, in the product, so that ``SimTokenizer`` computes a prompt's
ids with the very functions the simulator runs, without the gateway importing the simulator.

A token is a whitespace-separated word. Words of the vocabulary get ids 0..VOCAB_SIZE-1, any
other word a stable id above that (CRC-32, never Python's salted ``hash`` of a string), so the
same text always gives the same ids, in every process. A chat is rendered to one prompt string
first (``render_chat``).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, Final

_ONSETS: Final = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "st", "tr")
_VOWELS: Final = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
_CODAS: Final = ("", "n", "r", "s")

VOCAB: Final[tuple[str, ...]] = tuple(o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS)
VOCAB_SIZE: Final = len(VOCAB)
_VOCAB_INDEX: Final[dict[str, int]] = {w: i for i, w in enumerate(VOCAB)}


def word_id(word: str) -> int:
    known = _VOCAB_INDEX.get(word)
    if known is not None:
        return known
    return VOCAB_SIZE + zlib.crc32(word.encode("utf-8", "surrogatepass"))


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``: one per whitespace-separated word."""
    return [word_id(w) for w in text.split()]


def render_chat(messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
    """One prompt string for a chat, the same for the same messages.

    Each message becomes ``<|role|> content`` on its own line, then (unless
    ``add_generation_prompt`` is false, as with ``continue_final_message``) the generation
    prompt ``<|assistant|>``; content given as parts keeps its text parts. The template
    closes no message, so a final assistant message is left open to be continued: its
    tokens are the generation prompt's followed by the content's, as if generated.
    """
    lines = [f"<|{m['role']}|> {message_text(m)}" for m in messages]
    if add_generation_prompt:
        lines.append("<|assistant|>")
    return "\n".join(lines)


def message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return " ".join(
        part["text"]
        for part in content
        if isinstance(part, dict) and isinstance(part.get("text"), str)
    )
