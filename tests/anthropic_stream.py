"""Anthropic's streaming format, checked: what a client of ``/v1/messages`` may rely on.

``read_stream`` parses the named events of a Messages stream and raises ``AssertionError``
where they break Anthropic's rules: one ``message_start`` first; content blocks started at
index 0, 1, 2... without a gap or a repeat, each one's deltas between its start and its stop,
of its own kind; one ``message_delta`` after every block stopped; one ``message_stop`` last;
an ``error`` event ends the stream (no ``message_stop`` after it); ``ping`` anywhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_DELTA_OF = {"text": "text_delta", "tool_use": "input_json_delta", "thinking": "thinking_delta"}


@dataclass
class MessagesStream:
    message: dict[str, Any]  # message_start's message
    blocks: list[dict[str, Any]] = field(default_factory=list)  # each block, deltas applied
    stop_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)  # message_delta's
    error: dict[str, Any] | None = None  # an error event's error
    names: list[str] = field(default_factory=list)  # every event's name, in order

    @property
    def text(self) -> str:
        return "".join(b.get("text", "") for b in self.blocks if b["type"] == "text")


def events_of(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(name, data) of each event; a data line's ``type`` must be its event's name."""
    out = []
    for chunk in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        if not chunk.strip():
            continue
        name, data = "", []
        for line in chunk.decode().split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
        doc = json.loads("\n".join(data))
        assert name, f"an event without a name: {chunk!r}"
        assert doc.get("type") == name, f"event {name} carries type {doc.get('type')}"
        out.append((name, doc))
    return out


def read_stream(raw: bytes) -> MessagesStream:  # noqa: PLR0912 - one rule per branch
    events = [(n, d) for n, d in events_of(raw) if n != "ping"]
    assert events, "an empty stream"
    name, first = events[0]
    assert name == "message_start", f"the stream begins with {name}"
    stream = MessagesStream(message=first["message"])
    stream.names = [n for n, _ in events]
    open_block: int | None = None
    for i, (name, doc) in enumerate(events[1:], start=1):
        if stream.error is not None:
            raise AssertionError(f"{name} after an error event")
        if name == "message_start":
            raise AssertionError(f"a second message_start at event {i}")
        if name == "content_block_start":
            assert open_block is None, f"block {doc['index']} starts while {open_block} is open"
            assert doc["index"] == len(stream.blocks), (
                f"block index {doc['index']}, expected {len(stream.blocks)}"
            )
            assert stream.stop_reason is None, "a block after message_delta"
            stream.blocks.append(dict(doc["content_block"]))
            open_block = doc["index"]
        elif name == "content_block_delta":
            assert doc["index"] == open_block, f"a delta for {doc['index']}, open {open_block}"
            block, delta = stream.blocks[doc["index"]], doc["delta"]
            assert delta["type"] == _DELTA_OF[block["type"]], (block["type"], delta["type"])
            if delta["type"] == "text_delta":
                block["text"] = block.get("text", "") + delta["text"]
            elif delta["type"] == "input_json_delta":
                block["partial_json"] = block.get("partial_json", "") + delta["partial_json"]
            else:
                block["thinking"] = block.get("thinking", "") + delta["thinking"]
        elif name == "content_block_stop":
            assert doc["index"] == open_block, f"stop for {doc['index']}, open {open_block}"
            open_block = None
        elif name == "message_delta":
            assert open_block is None, "message_delta while a block is open"
            assert stream.stop_reason is None, "a second message_delta"
            stream.stop_reason = doc["delta"]["stop_reason"]
            stream.usage = doc.get("usage", {})
        elif name == "message_stop":
            assert i == len(events) - 1, "events after message_stop"
            assert stream.stop_reason is not None, "message_stop without message_delta"
        elif name == "error":
            stream.error = doc["error"]
        else:
            raise AssertionError(f"an unknown event {name}")
    if stream.error is None:
        assert stream.names[-1] == "message_stop", f"the stream ends with {stream.names[-1]}"
    return stream
