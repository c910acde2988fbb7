"""vLLM's KV-cache events in their wire form: the structs, the published hashes, a step's batch.

The structs are vLLM's (``vllm/distributed/kv_events.py``), msgpack-encoded with msgspec: the
tagged form of vLLM 0.11 and later (events as maps with a ``type`` field), and the positional
form of earlier versions (arrays whose first item names the event). ``to_wire`` turns the
events an engine step recorded (``kvcache.py``) into one batch of them.

The published hashes are digests of the engine's chain hashes (``wire_hash``): opaque like
vLLM's sha256-based ones, the same in every simulator process, and the int form is the
low 64 bits of the bytes form, as ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` derives it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal

import msgspec

from tools.sim.kvcache import CacheEvent, CacheRemoved, CacheStored, chain_hash

Wire = Literal["tagged", "positional"]
HashForm = Literal["int", "bytes"]
ExternalBlockHash = int | bytes
_Conv = Callable[[int], ExternalBlockHash]

MEDIUM_GPU: Final = "GPU"
# What vLLM 0.32 reports for the KV-cache group of a plain decoder model.
_GROUP: Final = 0
_SPEC_KIND: Final = "full_attention"
_HASH_PERSON: Final = b"llmgw-sim-kv"


# -- vLLM's structs (vllm/distributed/kv_events.py), the tagged form of 0.11 and later


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of vLLM's events: msgpack maps with a ``type`` field."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# -- the positional form of vLLM before 0.11 (array_like structs, the tag first)


class PositionalEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    """Base of the older events: msgpack arrays whose first item names the event."""


class PositionalBlockStored(PositionalEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class PositionalBlockRemoved(PositionalEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class PositionalAllBlocksCleared(PositionalEvent, tag="AllBlocksCleared"):
    pass


class PositionalKVEventBatch(EventBatch):
    events: list[PositionalBlockStored | PositionalBlockRemoved | PositionalAllBlocksCleared]


# -- hashes and events on the wire


def wire_hash(engine_hash: int, form: HashForm = "int") -> ExternalBlockHash:
    """The published hash of a block the engine keys by ``engine_hash`` (its chain hash):
    a 32-byte digest, or (``"int"``) that digest's low 64 bits as an unsigned int."""
    digest = hashlib.blake2b(
        engine_hash.to_bytes(8, "big", signed=True), digest_size=32, person=_HASH_PERSON
    ).digest()
    return digest if form == "bytes" else int.from_bytes(digest[24:], "big")


def block_hashes(
    token_ids: Sequence[int], block_size: int, form: HashForm = "int"
) -> list[ExternalBlockHash]:
    """The published hashes of the full blocks of ``token_ids`` (a prompt, say), in order:
    what a simulator's ``BlockStored`` events carry once it has cached them."""
    out: list[ExternalBlockHash] = []
    previous = 0
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        previous = chain_hash(previous, token_ids[start : start + block_size])
        out.append(wire_hash(previous, form))
    return out


def to_wire(
    events: Sequence[CacheEvent],
    *,
    block_size: int,
    wire: Wire = "tagged",
    hashes: HashForm = "int",
) -> EventBatch:
    """A batch of vLLM structs for the events a step recorded, stamped now (rank 0)."""
    h: dict[int, ExternalBlockHash] = {}  # one digest per hash, however often it appears

    def conv(engine_hash: int) -> ExternalBlockHash:
        out = h.get(engine_hash)
        if out is None:
            out = h[engine_hash] = wire_hash(engine_hash, hashes)
        return out

    if wire == "positional":
        return PositionalKVEventBatch(
            time.time(), [_positional(ev, block_size, conv) for ev in events], 0
        )
    return KVEventBatch(time.time(), [_tagged(ev, block_size, conv) for ev in events], 0)


def _tagged(
    ev: CacheEvent, block_size: int, conv: _Conv
) -> BlockStored | BlockRemoved | AllBlocksCleared:
    if isinstance(ev, CacheStored):
        return BlockStored(
            block_hashes=[conv(x) for x in ev.hashes],
            parent_block_hash=None if ev.parent is None else conv(ev.parent),
            token_ids=ev.token_ids,
            block_size=block_size,
            lora_id=None,
            medium=MEDIUM_GPU,
            lora_name=None,
            extra_keys=[None] * len(ev.hashes),  # vLLM 0.32 sends one (empty) entry per block
            group_idx=_GROUP,
            kv_cache_spec_kind=_SPEC_KIND,
        )
    if isinstance(ev, CacheRemoved):
        return BlockRemoved(block_hashes=[conv(ev.hash)], medium=MEDIUM_GPU, group_idx=_GROUP)
    return AllBlocksCleared()


def _positional(
    ev: CacheEvent, block_size: int, conv: _Conv
) -> PositionalBlockStored | PositionalBlockRemoved | PositionalAllBlocksCleared:
    if isinstance(ev, CacheStored):
        parent = None if ev.parent is None else conv(ev.parent)
        hashes = [conv(x) for x in ev.hashes]
        return PositionalBlockStored(hashes, parent, ev.token_ids, block_size, None, MEDIUM_GPU)
    if isinstance(ev, CacheRemoved):
        return PositionalBlockRemoved([conv(ev.hash)], MEDIUM_GPU)
    return PositionalAllBlocksCleared()
