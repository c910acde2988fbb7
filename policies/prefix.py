"""Prompt prefixes as chains of block hashes, and a bounded index of who received which.

The gateway cannot know a backend's tokenizer, so it hashes *characters*: the prompt (a
completion's ``prompt``, or a chat's messages rendered in order as role and content) is cut
into blocks of ``block_chars`` characters, and block *i*'s hash is the hash of block *i - 1*'s
hash and block *i*'s text. Two prompts share their first *k* hashes exactly when they share
their first *k* blocks of text, which is what a server's prefix cache keys on too (vLLM
hashes blocks of tokens the same way). About four characters make a token in English text,
so 64-character blocks are roughly vLLM's 16-token blocks. Only full blocks are hashed, and
at most ``max_blocks`` of them: the beginning of a prompt is what decides where it is cached.

Hashes use Python's ``hash`` of tuples: fast and stable within one process, which is all the
index needs (every gateway process keeps its own). They are not stable across processes.

``PrefixIndex`` remembers, for recently sent block hashes, which backends received them: an
LRU of at most ``capacity`` hashes. Recording and matching are O(blocks). ``PrefixHeat`` keeps
each matched prefix's share of recent routing decisions, to tell a hot prefix (one that needs
more than one backend) from the rest. Nothing here does I/O.
"""

from __future__ import annotations

import sys
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

# Separators that cannot be confused with text: a role boundary, a message boundary.
_ROLE_END: Final = "\x1f"
_MESSAGE_END: Final = "\x1e"


@dataclass(frozen=True, slots=True)
class PrefixHasher:
    """How prompts become block hashes: block size in characters and how many blocks count."""

    block_chars: int = 64
    max_blocks: int = 128

    def __post_init__(self) -> None:
        if self.block_chars < 1 or self.max_blocks < 1:
            raise ValueError("block_chars and max_blocks must be at least 1")

    @property
    def max_chars(self) -> int:
        return self.block_chars * self.max_blocks

    def facts(
        self, model: str, doc: Mapping[str, Any], *, keyed: bool = False
    ) -> tuple[tuple[int, ...], int | None]:
        """The chain of block hashes of a request body's prompt (``()`` if it has none) and,
        when ``keyed``, the prompt's ``stable_key`` (None without a full block)."""
        text = prompt_text(doc, self.max_chars)
        hashes = chain_hashes(text, self.block_chars, seed=model)
        return hashes, stable_key(model, text, self.block_chars) if keyed and hashes else None


# Leading blocks that name a prompt's prefix for placement across gateway replicas.
KEY_BLOCKS: Final = 8


def stable_key(model: str, text: str, block_chars: int) -> int:
    """The same number in every gateway process for prompts that begin alike.

    Block hashes use Python's ``hash``, which differs from process to process; replicas that
    must agree where a new prefix goes (rendezvous hashing) use this instead: a CRC-32 of the
    model and the prompt's first ``KEY_BLOCKS`` full blocks (fewer if it has fewer).
    """
    full = min(len(text) // block_chars, KEY_BLOCKS) * block_chars
    return zlib.crc32(f"{model}\x00{text[:full]}".encode())


def chain_hashes(text: str, block_chars: int, *, seed: object = None) -> tuple[int, ...]:
    """Hash of every full ``block_chars`` block of ``text``, each chained to the one before.

    ``seed`` starts the chain (the model name: two models never share a cache).
    """
    h = hash(seed)
    out = []
    for start in range(0, len(text) - block_chars + 1, block_chars):
        h = hash((h, text[start : start + block_chars]))
        out.append(h)
    return tuple(out)


def prompt_text(doc: Mapping[str, Any], max_chars: int) -> str:
    """The first ``max_chars`` characters of the request's prompt, as the hashes see it.

    Chat: each message's role, a separator, its text content (text parts joined), a message
    separator, in order. Completions: the prompt string; for a batch, its first prompt; token
    ids are written out as decimal numbers. Anything else: no prompt.
    """
    messages = doc.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for m in messages:
            if not isinstance(m, dict):
                continue
            piece = f"{m.get('role', '')}{_ROLE_END}{_content_text(m.get('content'))}{_MESSAGE_END}"
            parts.append(piece)
            size += len(piece)
            if size >= max_chars:
                break
        return "".join(parts)[:max_chars]
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return prompt[:max_chars]
    if isinstance(prompt, list):
        # Token ids: a bounded number of them, written out.
        return " ".join(str(t) for t in prompt[: max_chars // 2])[:max_chars]
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


# Rough per-object sizes for ``PrefixIndex.approx_bytes`` (CPython 3.11, 64-bit): an entry
# in the ordered dict (hash table slot, linked-list node, the int key) and a holders tuple.
_ENTRY_BYTES: Final = 104 + sys.getsizeof(2**62)
_TUPLE_BYTES: Final = sys.getsizeof(())
_REF_BYTES: Final = 8


class PrefixIndex:
    """Block hash -> backends that recently received it; at most ``capacity`` hashes (LRU).

    The backend ids are kept in small tuples: a hash is held by a few backends at most.
    """

    __slots__ = ("_entries", "_held", "_refs", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._entries: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        self._refs = 0  # backend ids over all entries
        self._held: dict[str, int] = {}  # backend -> entries naming it

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def refs(self) -> int:
        return self._refs

    def footprint(self, backend: str) -> int:
        """Blocks ``backend`` is believed to hold: how much of its cache the index fills."""
        return self._held.get(backend, 0)

    @property
    def approx_bytes(self) -> int:
        """Memory held by the index, estimated from its counts (not measured)."""
        return len(self._entries) * (_ENTRY_BYTES + _TUPLE_BYTES) + self._refs * _REF_BYTES

    def record(self, backend: str, hashes: Sequence[int]) -> list[int]:
        """``backend`` received a prompt with these block hashes: remember, evict the oldest.

        Returns the hashes ``backend`` was not already recorded for (what ``withdraw`` undoes).
        """
        entries = self._entries
        added: list[int] = []
        # Tail first, so a prompt's shared beginning is the most recently used and the last
        # to go (the way vLLM frees a sequence's blocks).
        for h in reversed(hashes):
            holders = entries.get(h)
            if holders is None:
                entries[h] = (backend,)
                added.append(h)
            else:
                if backend not in holders:
                    entries[h] = (*holders, backend)
                    added.append(h)
                entries.move_to_end(h)
        if added:
            self._refs += len(added)
            self._held[backend] = self._held.get(backend, 0) + len(added)
        self._evict_to(self.capacity)
        return added

    def withdraw(self, backend: str, hashes: Iterable[int]) -> None:
        """Forget that ``backend`` holds these hashes (an attempt that never reached it)."""
        entries = self._entries
        gone = 0
        for h in hashes:
            holders = entries.get(h)
            if holders is None or backend not in holders:
                continue
            rest = tuple(b for b in holders if b != backend)
            if rest:
                entries[h] = rest
            else:
                del entries[h]
            gone += 1
        if gone:
            self._refs -= gone
            left = self._held[backend] - gone
            if left:
                self._held[backend] = left
            else:
                del self._held[backend]

    def resize(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._evict_to(capacity)

    def _evict_to(self, capacity: int) -> None:
        entries = self._entries
        held = self._held
        while len(entries) > capacity:
            _, holders = entries.popitem(last=False)
            self._refs -= len(holders)
            for b in holders:
                if held[b] == 1:
                    del held[b]
                else:
                    held[b] -= 1

    def holders(self, h: int) -> tuple[str, ...]:
        return self._entries.get(h, ())

    def match(self, hashes: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        """For each of ``backends``, how many leading blocks of ``hashes`` it is believed to hold.

        Walks the chain until no backend holds the next block: O(blocks). Lookups do not
        refresh the LRU order; only ``record`` does.
        """
        lengths = dict.fromkeys(backends, 0)
        alive = set(lengths)
        entries = self._entries
        depth = 0
        last: tuple[str, ...] = ()
        for h in hashes:
            holders = entries.get(h)
            if not holders:
                break
            if holders != last:  # a chain's blocks mostly have the same holders
                still = alive.intersection(holders)
                if not still:
                    break
                for gone in alive - still:
                    lengths[gone] = depth
                alive = still
                last = holders
            depth += 1
        for b in alive:
            lengths[b] = depth
        return lengths


class PrefixHeat:
    """How much of the recent traffic each prefix carries: its share of routing decisions.

    ``observe(block)`` counts one decision whose prompt matched cached prefix ``block`` (the
    deepest block some backend is believed to hold; None for a prompt that matched nothing)
    and returns that block's recent share of all decisions. Counts are halved every
    ``window`` decisions, so the share follows the last few windows of traffic, and a block
    whose count falls below a quarter is forgotten: at most about ``4 * window`` keys.
    """

    __slots__ = ("_counts", "_since", "_total", "window")

    def __init__(self, window: int = 1000) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        self.window = window
        self._counts: dict[int, float] = {}
        self._total = 0.0
        self._since = 0

    def __len__(self) -> int:
        return len(self._counts)

    def observe(self, block: int | None) -> float:
        self._total += 1.0
        self._since += 1
        share = 0.0
        if block is not None:
            count = self._counts.get(block, 0.0) + 1.0
            self._counts[block] = count
            share = count / self._total
        if self._since >= self.window:
            self._since = 0
            self._total /= 2.0
            self._counts = {k: v / 2.0 for k, v in self._counts.items() if v >= 0.5}
        return share
