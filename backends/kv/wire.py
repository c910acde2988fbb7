"""vLLM's KV-cache event wire format, decoded into ``policies.kv_index`` events. Pure.

A ZMQ message is ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian counter from 0 per
publisher process, ``payload`` a msgpack ``EventBatch``, an array ``[ts, events, dp_rank]``.
The events changed shape between vLLM releases, and a consumer that expects one silently
receives nothing from the other, so both are read:

- **tagged** (vLLM >= 0.11, msgspec ``tag=True`` structs): maps with a ``type`` field,
  ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids":
  [...], "block_size": 16, "lora_id": None, "medium": "GPU", ...}``;
- **positional** (earlier, ``array_like`` structs): ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium]``, ``["BlockRemoved",
  block_hashes, medium]``, ``["AllBlocksCleared"]``.

Hashes are ints or bytes (sha256 digests, vLLM's default since 0.10); both are used as they
come. Blocks stored off the GPU (``medium`` "CPU" or a storage tier, by a KV offloader) and
blocks of a KV-cache group other than the first (hybrid models) are not what a request's
prefill can reuse on this engine's GPU, so they are skipped. What cannot be read is counted by
kind in ``Decoded.problems``, never raised: one bad message must not stop a feed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from policies.kv_index import Cleared, Event, Removed, Stored

END_SEQ: Final = -1  # the replay socket's end marker (8 bytes, signed)
_GPU: Final = (None, "GPU", "gpu")
_decoder: Final = msgspec.msgpack.Decoder()


@dataclass(slots=True)
class Decoded:
    """One batch: its events, its timestamp and rank, and what could not be read in it."""

    events: list[Event] = field(default_factory=list)
    ts: float | None = None
    rank: int | None = None
    form: str | None = None  # "tagged" or "positional": what this publisher speaks
    problems: dict[str, int] = field(default_factory=dict)
    skipped: int = 0  # events read but not for this index (another medium or group)

    def problem(self, kind: str) -> None:
        self.problems[kind] = self.problems.get(kind, 0) + 1


def seq_of(frame: bytes) -> int:
    """A message's sequence number (the replay end marker is -1)."""
    return int.from_bytes(frame, "big", signed=True)


def decode(payload: bytes) -> Decoded:
    out = Decoded()
    try:
        doc = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError):
        out.problem("undecodable")
        return out
    if not isinstance(doc, list | tuple) or len(doc) < 2 or not isinstance(doc[1], list):
        out.problem("not_a_batch")
        return out
    if isinstance(doc[0], int | float):
        out.ts = float(doc[0])
    if len(doc) > 2 and isinstance(doc[2], int):
        out.rank = doc[2]
    for raw in doc[1]:
        if isinstance(raw, Mapping):
            out.form = "tagged"
            _tagged(raw, out)
        elif isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
            out.form = "positional"
            _positional(raw, out)
        else:
            out.problem("unknown_event_shape")
    return out


def _tagged(raw: Mapping[str, Any], out: Decoded) -> None:
    kind = raw.get("type")
    if kind == "BlockStored":
        _stored(
            out,
            raw.get("block_hashes"),
            raw.get("parent_block_hash"),
            raw.get("token_ids"),
            raw.get("block_size"),
            medium=raw.get("medium"),
            group=raw.get("group_idx"),
            extra=_extra(raw.get("lora_name") or raw.get("lora_id"), raw.get("extra_keys")),
        )
    elif kind == "BlockRemoved":
        _removed(out, raw.get("block_hashes"), raw.get("medium"), raw.get("group_idx"))
    elif kind == "AllBlocksCleared":
        out.events.append(Cleared())
    else:
        out.problem("unknown_event_type")


def _positional(raw: Sequence[Any], out: Decoded) -> None:
    kind = raw[0]

    def at(i: int) -> Any:
        return raw[i] if len(raw) > i else None

    if kind == "BlockStored":
        _stored(out, at(1), at(2), at(3), at(4), medium=at(6), group=None, extra=_extra(at(5)))
    elif kind == "BlockRemoved":
        _removed(out, at(1), at(2), None)
    elif kind == "AllBlocksCleared":
        out.events.append(Cleared())
    else:
        out.problem("unknown_event_type")


def _extra(lora: Any, extra_keys: Any = None) -> tuple[Any, list[Any] | None]:
    """What besides tokens went into the blocks' hashes: the LoRA (all blocks), and the
    extra keys vLLM sends one entry per block."""
    return (
        lora if isinstance(lora, str | int) else None,
        extra_keys if isinstance(extra_keys, list) else None,
    )


def _mixed(lora: Any, extra_keys: bytes | None = None) -> Any:
    """The ``Stored.extra`` of blocks hashed with ``lora`` and ``extra_keys`` (None: plain)."""
    if lora is None and extra_keys is None:
        return None
    return ("extra", lora, extra_keys)


def _stored(
    out: Decoded,
    hashes: Any,
    parent: Any,
    tokens: Any,
    block_size: Any,
    *,
    medium: Any,
    group: Any,
    extra: Any,
) -> None:
    if not (
        isinstance(hashes, list)
        and isinstance(tokens, list)
        and isinstance(block_size, int)
        and block_size > 0
    ):
        out.problem("malformed_block_stored")
        return
    if (
        not all(isinstance(h, int | bytes) for h in hashes)
        or not isinstance(parent, int | bytes | None)
        or not all(type(t) is int for t in tokens)
    ):
        out.problem("malformed_block_stored")
        return
    if medium not in _GPU or group not in (None, 0):
        out.skipped += 1
        return
    lora, per_block = extra
    first = next((i for i, k in enumerate(per_block or ()) if k is not None), None)
    if first is None or first >= len(hashes):
        out.events.append(Stored(hashes, parent, tokens, block_size, _mixed(lora, None)))
        return
    # Blocks before the first one with extra keys (an image, a salt) are plain text blocks:
    # they keep plain keys; from that block on, the keys (chained) differ from any text's.
    if first:
        out.events.append(
            Stored(hashes[:first], parent, tokens[: first * block_size], block_size, _mixed(lora))
        )
    extra_keys = msgspec.msgpack.encode(per_block[first:])  # nested lists: made hashable
    out.events.append(
        Stored(
            hashes[first:],
            hashes[first - 1] if first else parent,
            tokens[first * block_size :],
            block_size,
            _mixed(lora, extra_keys),
        )
    )


def _removed(out: Decoded, hashes: Any, medium: Any, group: Any) -> None:
    if not isinstance(hashes, list) or not all(isinstance(h, int | bytes) for h in hashes):
        out.problem("malformed_block_removed")
        return
    if medium not in _GPU or group not in (None, 0):
        out.skipped += 1
        return
    out.events.append(Removed(hashes))
