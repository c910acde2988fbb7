"""vLLM's ``--kv-events-config``, parsed (``KvEventsConfig``), plus the simulator's own wire
options (``kvevents.py`` says what they are for). Apart from the publisher, which it configures,
so neither imports the other's importer."""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from tools.sim.kvwire import HashForm, Wire


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
