"""Paged KV cache with prefix caching, after vLLM V1's block pool.

Blocks of ``block_size`` tokens. A block that holds a full, computed block of a
sequence's tokens is registered under its chain hash (the hash of the previous
block's hash and this block's token ids), so a later request whose prompt starts
with the same tokens reuses it instead of computing it again.

Blocks nobody references sit in ``_free`` in eviction order (least recently freed
first); a free block that is still registered is a cache entry, evicted (its hash
dropped) only when the block is handed out again. Sequences free their blocks tail
first, so the end of a prompt is evicted before its shared beginning.

With KV-cache events on (``record_events``), the pool records what vLLM's block pool
reports: a store when a hash is registered, a removal when a cached hash is evicted, a
clear on ``clear()``. The records use the pool's own hashes; ``kvevents.py`` turns them
into vLLM's wire structs. With events off nothing is recorded (``events`` is None), so
the hot paths pay one attribute test.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class CacheStored:
    """Blocks newly cached, consecutive in one sequence: ``hashes[i]`` holds
    ``token_ids[i*bs:(i+1)*bs]``; ``parent`` is the hash of the block before the first
    (None for a sequence's first block). vLLM's ``BlockStored``."""

    hashes: list[int]
    parent: int | None
    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class CacheRemoved:
    """A cached hash evicted (its block handed out again). vLLM's ``BlockRemoved``."""

    hash: int


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """Every cached hash dropped by ``clear()``. vLLM's ``AllBlocksCleared``."""


CacheEvent = CacheStored | CacheRemoved | CacheCleared


class BlockPool:
    """Allocation, reference counts and the prefix-cache index of the KV blocks."""

    __slots__ = ("_cached", "_free", "_hash_of", "_ref", "block_size", "events", "num_blocks")

    def __init__(self, num_blocks: int, block_size: int, *, record_events: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: dict[int, int] = {}
        self._cached: dict[int, int] = {}  # chain hash -> block id
        # What changed in the cache since the last take_events(); None: not recorded.
        self.events: list[CacheEvent] | None = [] if record_events else None

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
                if self.events is not None:
                    self.events.append(CacheRemoved(stale))
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

    def register(
        self,
        block: int,
        chain_hash: int,
        parent: int | None = None,
        tokens: Sequence[int] = (),
    ) -> None:
        """Record that ``block`` now holds the full block with ``chain_hash``.

        ``parent`` (the previous block's chain hash, None for a first block) and the
        block's ``tokens`` are only needed, and only read, when events are recorded.
        """
        if chain_hash in self._cached or block in self._hash_of:
            return  # an identical block computed concurrently keeps the entry
        self._cached[chain_hash] = block
        self._hash_of[block] = chain_hash
        if self.events is not None:
            self._record_store(chain_hash, parent, tokens)

    def _record_store(self, chain_hash: int, parent: int | None, tokens: Sequence[int]) -> None:
        """One event per run of consecutive blocks, as vLLM sends a request's new blocks:
        a block whose parent ends the last store continues it."""
        events = self.events
        assert events is not None
        last = events[-1] if events else None
        if isinstance(last, CacheStored) and parent is not None and last.hashes[-1] == parent:
            last.hashes.append(chain_hash)
            last.token_ids.extend(tokens)
        else:
            events.append(CacheStored([chain_hash], parent, list(tokens)))

    def cached_run(self, tokens: Sequence[int]) -> int:
        """How many leading full blocks of ``tokens`` are cached now (nothing is referenced):
        what a request with this prompt would find, for tests and the admin view."""
        n, prev = 0, 0
        bs = self.block_size
        for i in range(0, len(tokens) // bs * bs, bs):
            prev = chain_hash(prev, tokens[i : i + bs])
            if prev not in self._cached:
                break
            n += 1
        return n

    def clear(self) -> bool:
        """Reset the prefix cache: drop every cached hash. As vLLM's
        ``reset_prefix_cache``, refuse (False, nothing dropped) while any block is in use,
        so that no running sequence holds a block the cache no longer knows."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._hash_of.clear()
        if self.events is not None:
            self.events.append(CacheCleared())
        return True

    def take_events(self) -> list[CacheEvent]:
        """The events recorded since the last call (none when events are off)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, tail first."""
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None


def chain_hash(previous: int, block_tokens: Sequence[int]) -> int:
    """The prefix-cache key of a full block: depends on every token before it too."""
    return hash((previous, *block_tokens))
