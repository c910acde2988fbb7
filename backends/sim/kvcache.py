"""Paged KV cache with prefix caching, after vLLM V1's block pool.

Blocks of ``block_size`` tokens. A block that holds a full, computed block of a
sequence's tokens is registered under its chain hash (the hash of the previous
block's hash and this block's token ids), so a later request whose prompt starts
with the same tokens reuses it instead of computing it again.

Blocks nobody references sit in ``_free`` in eviction order (least recently freed
first); a free block that is still registered is a cache entry, evicted (its hash
dropped) only when the block is handed out again. Sequences free their blocks tail
first, so the end of a prompt is evicted before its shared beginning.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockPool:
    """Allocation, reference counts and the prefix-cache index of the KV blocks."""

    __slots__ = ("_cached", "_free", "_hash_of", "_ref", "block_size", "num_blocks")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: dict[int, int] = {}
        self._cached: dict[int, int] = {}  # chain hash -> block id

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (cached but unreferenced ones included)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, as ``vllm:kv_cache_usage_perc`` reports it."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks, or None (and nothing taken) if too few are free."""
        if count > len(self._free):
            return None
        blocks = []
        for _ in range(count):
            block, _none = self._free.popitem(last=False)
            stale = self._hash_of.pop(block, None)
            if stale is not None:
                del self._cached[stale]
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Take a reference on the longest cached run of ``hashes`` (at most max_blocks)."""
        hits: list[int] = []
        for h in hashes[:max_blocks]:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        for block in hits:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1
        return hits

    def register(self, block: int, chain_hash: int) -> None:
        """Record that ``block`` now holds the full block with ``chain_hash``."""
        if chain_hash in self._cached or block in self._hash_of:
            return  # an identical block computed concurrently keeps the entry
        self._cached[chain_hash] = block
        self._hash_of[block] = chain_hash

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, tail first."""
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None


def chain_hash(previous: int, block_tokens: Sequence[int]) -> int:
    """The prefix-cache key of a full block: depends on every token before it too."""
    return hash((previous, *block_tokens))
