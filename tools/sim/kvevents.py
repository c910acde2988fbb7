"""vLLM's KV-cache events, published by the simulator in vLLM 0.32's wire form.

With ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``
(vLLM's flag and JSON) the simulator tells subscribers what its prefix cache holds, as
vLLM's ``ZmqEventPublisher`` does. The flag is parsed in ``kvconfig.py`` (``KvEventsConfig``), the
events' wire form is in ``kvwire.py`` and the ZMQ publisher in ``kvpublisher.py``; their names
are importable from here.

Two simulator-only keys, so that a gateway's reading of older publishers can be tested:
``"wire": "positional"`` sends the events as arrays (vLLM before 0.11: ``["BlockStored",
block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``), and
``"hashes": "bytes"`` sends block hashes as 32-byte strings instead of ints.
"""

from __future__ import annotations

# Tests patch ``tools.sim.kvevents.zmq.Context``: the publisher's zmq, reached from here.
import zmq  # noqa: F401

from tools.sim.kvconfig import KvEventsConfig
from tools.sim.kvpublisher import END_SEQ, KvEventPublisher, KvEvents, is_bind_endpoint
from tools.sim.kvwire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    HashForm,
    KVCacheEvent,
    KVEventBatch,
    PositionalAllBlocksCleared,
    PositionalBlockRemoved,
    PositionalBlockStored,
    PositionalEvent,
    PositionalKVEventBatch,
    Wire,
    block_hashes,
    to_wire,
    wire_hash,
)

__all__ = [
    "END_SEQ",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExternalBlockHash",
    "HashForm",
    "KVCacheEvent",
    "KVEventBatch",
    "KvEventPublisher",
    "KvEvents",
    "KvEventsConfig",
    "PositionalAllBlocksCleared",
    "PositionalBlockRemoved",
    "PositionalBlockStored",
    "PositionalEvent",
    "PositionalKVEventBatch",
    "Wire",
    "block_hashes",
    "is_bind_endpoint",
    "to_wire",
    "wire_hash",
]
