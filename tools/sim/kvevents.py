"""vLLM's KV-cache events, published by the simulator in vLLM 0.32's wire form.

With ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``
(vLLM's flag and JSON) the simulator tells subscribers what its prefix cache holds, as
vLLM's ``ZmqEventPublisher`` does. This module parses the flag (``KvEventsConfig``); the
events' wire form is in ``kvwire.py`` and the ZMQ publisher in ``kvpublisher.py``, and their
names are importable from here too.

Two simulator-only keys, so that a gateway's reading of older publishers can be tested:
``"wire": "positional"`` sends the events as arrays (vLLM before 0.11: ``["BlockStored",
block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``), and
``"hashes": "bytes"`` sends block hashes as 32-byte strings instead of ints.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

# Tests patch ``tools.sim.kvevents.zmq.Context``: the publisher's zmq, reached from here.
import zmq  # noqa: F401

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


# -- configuration: vLLM's KVEventsConfig, plus the simulator's wire options


class KvEventsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``--kv-events-config`` (``vllm/config/kv_events.py``); ``wire`` and
    ``hashes`` are the simulator's own. ``max_queue_size`` is accepted and reported but
    has no effect: the simulator sends from the loop, with no queue in between."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: "zmq" if enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    wire: Wire = "tagged"
    hashes: HashForm = "int"

    def __post_init__(self) -> None:
        if self.buffer_steps < 0:
            raise ValueError(f"buffer_steps must not be negative, got {self.buffer_steps}")
        if self.hwm < 0:
            raise ValueError(f"hwm must not be negative, got {self.hwm}")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be at least 1, got {self.max_queue_size}")
        if not self.endpoint:
            raise ValueError("endpoint must not be empty")

    @classmethod
    def from_json(cls, text: str) -> KvEventsConfig:
        """Parse the flag's JSON; a ValueError names what is wrong (an unknown key too)."""
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        unknown = sorted(set(doc) - set(cls.__struct_fields__))
        if unknown:
            raise ValueError(
                f"--kv-events-config: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(cls.__struct_fields__)}"
            )
        try:
            return msgspec.convert(doc, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"--kv-events-config: {exc}") from None

    @property
    def publisher_kind(self) -> Literal["null", "zmq"]:
        """vLLM's resolved ``publisher``."""
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"

    @property
    def active(self) -> bool:
        """Whether events are published at all (vLLM's factory: else a null publisher)."""
        return self.enable_kv_cache_events and self.publisher_kind == "zmq"

    def source(self, endpoint: str, replay_endpoint: str | None) -> dict[str, Any]:
        """One rank's entry of ``/kv_event_sources``: vLLM's fields, the bound endpoints."""
        return {
            "enable_kv_cache_events": self.enable_kv_cache_events,
            "publisher": self.publisher_kind,
            "endpoint": endpoint,
            "replay_endpoint": replay_endpoint,
            "buffer_steps": self.buffer_steps,
            "hwm": self.hwm,
            "max_queue_size": self.max_queue_size,
            "topic": self.topic,
        }
