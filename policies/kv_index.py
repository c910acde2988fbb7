"""What each backend's prefix cache really holds, kept from its engine's KV-cache events. Pure.

vLLM publishes a ``BlockStored`` event for every full block it caches (its hash, its parent's
hash, its token ids) and a ``BlockRemoved`` when it evicts one. This index keeps, per backend,
the set of cached blocks under the gateway's **own keys**, chained from token ids
(``chain_keys``): a block's key is the hash of its parent's key and its tokens, so it names
the whole prefix up to and including it, and it does not depend on the engine's hash function
or seed (vLLM seeds its first block's hash per process unless ``PYTHONHASHSEED`` is set). The
engine's hashes are kept only to find a removed block's key and a new block's parent.

Lookups walk a request's keys once over all candidates: each key maps to a bitmask of the
backends holding it, and a backend drops out at its first miss, as vLLM's own lookup stops at
the first block it does not hold. Memory is bounded per backend (``capacity`` blocks, oldest
stored first out: an engine cannot hold more blocks than its cache has, so entries past that
are ones whose removal was missed); ``stats`` reports the sizes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

ROOT: Final = 0  # the "parent key" of a prompt's first block
EngineHash = Hashable  # vLLM's block hash: an int, or bytes (sha256) since 0.10


def chain_keys(tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """The keys of the full blocks of ``tokens`` (at most ``limit``), chained from ``ROOT``.

    ``hash`` of a tuple of ints is not salted per process (only str and bytes are), so every
    gateway replica computes the same keys.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    full = len(tokens) // block_size
    if limit is not None:
        full = min(full, limit)
    keys: list[int] = []
    prev = ROOT
    for i in range(0, full * block_size, block_size):
        prev = hash((prev, *tokens[i : i + block_size]))
        keys.append(prev)
    return keys


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """How many blocks of a prompt an engine can serve from its cache: vLLM always computes
    the prompt's last token (it needs its logits), so at most ``(n - 1) // block_size``."""
    return max(0, num_tokens - 1) // block_size


@dataclass(frozen=True, slots=True)
class Stored:
    """A run of blocks an engine cached: ``hashes[i]`` holds ``tokens[i*bs:(i+1)*bs]``."""

    hashes: Sequence[EngineHash]
    parent: EngineHash | None
    tokens: Sequence[int]
    block_size: int
    # The block hash also covered something besides the tokens (a LoRA, a cache salt, an
    # image): such blocks get keys that no plain prompt's keys equal.
    extra: Hashable = None


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: Sequence[EngineHash]


@dataclass(frozen=True, slots=True)
class Cleared:
    """The engine dropped its whole prefix cache (``AllBlocksCleared``)."""


Event = Stored | Removed | Cleared


@dataclass(slots=True)
class _Cache:
    bit: int
    block_size: int | None = None
    engine: OrderedDict[EngineHash, int] = field(default_factory=OrderedDict)  # -> our key
    counts: dict[int, int] = field(default_factory=dict)  # our key -> engine hashes holding it
    stored: int = 0
    removed: int = 0
    orphans: int = 0  # stored blocks whose parent was unknown (missed events): not indexed
    evicted: int = 0  # dropped past the capacity


@dataclass(frozen=True, slots=True)
class CacheStats:
    blocks: int
    block_size: int | None
    stored: int
    removed: int
    orphans: int
    evicted: int


# Blocks remembered per backend by default: more than most engines' KV cache holds.
KV_CAPACITY: Final = 262_144


class KvIndex:
    """Per backend, the keys of the blocks its engine holds; bounded by ``capacity`` each."""

    __slots__ = ("_caches", "_free_bits", "_holders", "_live", "_next_bit", "capacity")

    def __init__(self, capacity: int = KV_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._caches: dict[str, _Cache] = {}
        self._holders: dict[int, int] = {}  # our key -> bitmask of the backends holding it
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._live: set[str] = set()

    # -- whose events are followed ----------------------------------------------------------

    def set_live(self, backend: str, live: bool) -> None:
        """Whether ``backend``'s events are being received now (connected, in sequence).

        A backend that is not live is not known exactly: the policy falls back for it.
        """
        if live:
            self._live.add(backend)
        else:
            self._live.discard(backend)

    def exact(self, backend: str) -> bool:
        return backend in self._live

    # -- what the event feeds call ---------------------------------------------------------

    def apply(self, backend: str, events: Iterable[Event]) -> None:
        cache = self._cache(backend)
        for ev in events:
            if isinstance(ev, Stored):
                self._store(cache, ev)
            elif isinstance(ev, Removed):
                self._remove(cache, ev.hashes)
            else:
                self._clear(cache)

    def clear(self, backend: str) -> None:
        """Forget what ``backend`` holds (it restarted, or died) but keep its counters."""
        cache = self._caches.get(backend)
        if cache is not None:
            self._clear(cache)

    def forget(self, backend: str) -> None:
        """``backend`` left the fleet: drop it entirely."""
        self._live.discard(backend)
        cache = self._caches.pop(backend, None)
        if cache is not None:
            self._clear(cache)
            self._free_bits.append(cache.bit)

    # -- what the policy calls -------------------------------------------------------------

    def block_size(self, backend: str) -> int | None:
        """The block size ``backend``'s events reported (``None``: none seen yet)."""
        cache = self._caches.get(backend)
        return None if cache is None else cache.block_size

    def match(self, keys: Sequence[int], backends: Sequence[str]) -> dict[str, int]:
        """For each of ``backends``, how many of ``keys`` it holds from the first on."""
        out = dict.fromkeys(backends, 0)
        bits: dict[int, str] = {}
        for b in backends:
            cache = self._caches.get(b)
            if cache is not None and cache.counts:
                bits[1 << cache.bit] = b
        mask = sum(bits)
        holders = self._holders
        for i, key in enumerate(keys):
            if not mask:
                return out
            held = holders.get(key, 0) & mask
            dropped = mask & ~held
            if dropped:
                for bit, b in bits.items():
                    if dropped & bit:
                        out[b] = i
            mask = held
        for bit, b in bits.items():
            if mask & bit:
                out[b] = len(keys)
        return out

    def blocks(self, backend: str) -> int:
        cache = self._caches.get(backend)
        return 0 if cache is None else len(cache.counts)

    def stats(self) -> Mapping[str, CacheStats]:
        return {
            b: CacheStats(len(c.counts), c.block_size, c.stored, c.removed, c.orphans, c.evicted)
            for b, c in self._caches.items()
        }

    @property
    def size(self) -> int:
        """Entries held over all backends (what the index's memory grows with)."""
        return sum(len(c.engine) for c in self._caches.values())

    # -- internals -------------------------------------------------------------------------

    def _cache(self, backend: str) -> _Cache:
        cache = self._caches.get(backend)
        if cache is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit, self._next_bit = self._next_bit, self._next_bit + 1
            cache = self._caches[backend] = _Cache(bit)
        return cache

    def _store(self, cache: _Cache, ev: Stored) -> None:
        bs = ev.block_size
        if bs <= 0 or len(ev.tokens) < bs * len(ev.hashes):
            cache.orphans += len(ev.hashes)  # malformed: nothing can be keyed from it
            return
        if ev.parent is None:
            prev = ROOT
        else:
            parent = cache.engine.get(ev.parent)
            if parent is None:
                cache.orphans += len(ev.hashes)
                return
            prev = parent
        cache.block_size = bs
        bit = 1 << cache.bit
        engine, counts, holders = cache.engine, cache.counts, self._holders
        for j, h in enumerate(ev.hashes):
            block = ev.tokens[j * bs : (j + 1) * bs]
            key = hash((prev, *block)) if ev.extra is None else hash((prev, ev.extra, *block))
            cache.stored += 1
            old = engine.get(h)
            if old is not None:
                engine.move_to_end(h)
                if old == key:
                    prev = key
                    continue
                self._drop(cache, old)
            engine[h] = key
            n = counts.get(key, 0)
            counts[key] = n + 1
            if not n:
                holders[key] = holders.get(key, 0) | bit
            prev = key
        while len(engine) > self.capacity:
            _h, key = engine.popitem(last=False)
            self._drop(cache, key)
            cache.evicted += 1

    def _remove(self, cache: _Cache, hashes: Sequence[EngineHash]) -> None:
        for h in hashes:
            key = cache.engine.pop(h, None)
            if key is not None:
                cache.removed += 1
                self._drop(cache, key)

    def _drop(self, cache: _Cache, key: int) -> None:
        n = cache.counts[key] - 1
        if n:
            cache.counts[key] = n
            return
        del cache.counts[key]
        rest = self._holders.get(key, 0) & ~(1 << cache.bit)
        if rest:
            self._holders[key] = rest
        else:
            self._holders.pop(key, None)

    def _clear(self, cache: _Cache) -> None:
        bit = ~(1 << cache.bit)
        holders = self._holders
        for key in cache.counts:
            rest = holders.get(key, 0) & bit
            if rest:
                holders[key] = rest
            else:
                holders.pop(key, None)
        cache.engine.clear()
        cache.counts.clear()
