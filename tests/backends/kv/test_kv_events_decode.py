"""vLLM's KV-event batches decoded: both wire forms, what is skipped, what cannot be read."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest

from backends.kv.wire import END_SEQ, Decoded, decode, seq_of
from policies.kv_index import Cleared, KvIndex, Removed, Stored, chain_keys

TOKENS = list(range(100, 116))  # four blocks of four
H1, H2 = b"\x01" * 32, b"\x02" * 32  # sha256 block hashes (vLLM's default since 0.10)
VLLM_PYTHON = Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"


def batch(events: list[Any], ts: float = 1.5, rank: int | None = 0) -> bytes:
    """``KVEventBatch`` as vLLM encodes it: array_like, the rank omitted when it is None."""
    doc: list[Any] = [ts, events] if rank is None else [ts, events, rank]
    return msgspec.msgpack.encode(doc)


def block_stored(
    hashes: list[Any],
    parent: Any = None,
    tokens: list[Any] | None = None,
    block_size: Any = 4,
    **more: Any,
) -> dict[str, Any]:
    """A tagged ``BlockStored`` map: the fields without defaults always, the rest if given."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": TOKENS[: 4 * len(hashes)] if tokens is None else tokens,
        "block_size": block_size,
        "lora_id": more.pop("lora_id", None),
        "medium": more.pop("medium", "GPU"),
        "lora_name": more.pop("lora_name", None),
        **more,
    }


def block_removed(hashes: list[Any], medium: Any = "GPU", **more: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, **more}


CLEARED: dict[str, Any] = {"type": "AllBlocksCleared"}


def clean(out: Decoded) -> Decoded:
    assert out.problems == {}
    assert out.skipped == 0
    return out


# -- the tagged form (vLLM >= 0.11) ----------------------------------------------------------


def test_a_tagged_batch_is_decoded_with_its_timestamp_and_rank() -> None:
    events = [block_stored([1, 2]), block_stored([3], parent=2, tokens=TOKENS[8:12])]
    payload = batch(
        [*events, block_removed([3]), CLEARED],
        ts=1700000000.25,
        rank=3,
    )
    out = clean(decode(payload))
    assert out.form == "tagged"
    assert out.ts == 1700000000.25
    assert out.rank == 3
    assert out.events == [
        Stored([1, 2], None, TOKENS[:8], 4),
        Stored([3], 2, TOKENS[8:12], 4),
        Removed([3]),
        Cleared(),
    ]


def test_a_batch_without_a_rank_and_an_int_timestamp() -> None:
    out = clean(decode(batch([CLEARED], ts=7, rank=None)))
    assert out.rank is None
    assert out.ts == 7.0
    assert isinstance(out.ts, float)
    assert out.events == [Cleared()]


def test_an_empty_batch_has_no_events_and_no_problems() -> None:
    out = clean(decode(batch([])))
    assert out.events == []
    assert out.form is None


@pytest.mark.parametrize(
    ("hashes", "parent"),
    [([11, 12], 10), ([H1, H2], b"\x00" * 32), ([11, H2], H1), ([2**63 - 1, -5], None)],
)
def test_hashes_are_ints_or_bytes_kept_as_they_come(hashes: list[Any], parent: Any) -> None:
    out = clean(decode(batch([block_stored(hashes, parent), block_removed(hashes[:1])])))
    assert out.events == [Stored(hashes, parent, TOKENS[:8], 4), Removed(hashes[:1])]


def test_the_fields_vllm_adds_with_defaults_are_accepted() -> None:
    ev = block_stored(
        [1],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        locality="LOCAL",
        session_id="s",
        extra_keys=[None],
    )
    out = clean(decode(batch([ev, block_removed([1], group_idx=0)])))
    assert out.events == [Stored([1], None, TOKENS[:4], 4), Removed([1])]


@pytest.mark.parametrize("medium", [None, "GPU", "gpu"])
def test_gpu_blocks_are_kept(medium: str | None) -> None:
    out = clean(decode(batch([block_stored([1], medium=medium), block_removed([1], medium)])))
    assert len(out.events) == 2


@pytest.mark.parametrize("medium", ["CPU", "STORAGE", "disk"])
def test_blocks_off_the_gpu_are_skipped(medium: str) -> None:
    events = [block_stored([1], medium=medium), block_removed([1], medium), block_stored([2])]
    out = decode(batch(events))
    assert out.problems == {}
    assert out.skipped == 2
    assert out.events == [Stored([2], None, TOKENS[:4], 4)]


def test_blocks_of_another_kv_cache_group_are_skipped() -> None:
    events = [
        block_stored([1], group_idx=1),
        block_removed([1], group_idx=2),
        block_stored([2], group_idx=0),
        block_removed([2], group_idx=0),
    ]
    out = decode(batch(events))
    assert out.problems == {}
    assert out.skipped == 2
    assert out.events == [Stored([2], None, TOKENS[:4], 4), Removed([2])]


def test_lora_blocks_are_marked_extra_and_never_match_a_plain_prompt() -> None:
    by_name = block_stored([1, 2], lora_name="adapter", lora_id=7)
    by_id = block_stored([3, 4], lora_id=7)  # vLLM before lora_name
    plain = block_stored([5, 6])
    out = clean(decode(batch([by_name, by_id, plain])))
    extras = [ev.extra for ev in out.events if isinstance(ev, Stored)]
    assert extras[0] is not None
    assert extras[1] is not None
    assert extras[0] != extras[1]  # another adapter name than id: other keys
    assert extras[2] is None
    index = KvIndex()
    index.apply("lora", out.events[:2])
    index.apply("plain", out.events[2:])
    assert index.match(chain_keys(TOKENS, 4), ["lora", "plain"]) == {"lora": 0, "plain": 2}


def test_extra_keys_such_as_a_cache_salt_make_blocks_extra() -> None:
    salted = block_stored([1, 2], extra_keys=[["my-salt"], None])
    plain = block_stored([3, 4], extra_keys=[None, None])
    out = clean(decode(batch([salted, plain])))
    first, second = out.events
    assert isinstance(first, Stored)
    assert isinstance(second, Stored)
    assert first.extra is not None
    assert second.extra is None
    index = KvIndex()
    index.apply("a", [first])
    assert index.match(chain_keys(TOKENS, 4), ["a"]) == {"a": 0}
    # Another salt: other keys again.
    other = decode(batch([block_stored([1, 2], extra_keys=[["other"], None])])).events[0]
    assert isinstance(other, Stored)
    assert other.extra != first.extra


# -- the positional form (vLLM before 0.11) --------------------------------------------------


def test_a_positional_batch_is_decoded() -> None:
    events = [
        ["BlockStored", [1, 2], None, TOKENS[:8], 4, None, "GPU"],
        ["BlockStored", [H1], 2, TOKENS[8:12], 4],  # medium omitted: older still
        ["BlockRemoved", [1], "GPU"],
        ["BlockRemoved", [H1]],
        ["AllBlocksCleared"],
    ]
    out = clean(decode(batch(events, rank=None)))
    assert out.form == "positional"
    assert out.events == [
        Stored([1, 2], None, TOKENS[:8], 4),
        Stored([H1], 2, TOKENS[8:12], 4),
        Removed([1]),
        Removed([H1]),
        Cleared(),
    ]


def test_positional_blocks_off_the_gpu_are_skipped_and_a_lora_is_extra() -> None:
    events = [
        ["BlockStored", [1], None, TOKENS[:4], 4, None, "CPU"],
        ["BlockRemoved", [1], "CPU"],
        ["BlockStored", [2], None, TOKENS[:4], 4, 3, "GPU"],
    ]
    out = decode(batch(events))
    assert out.problems == {}
    assert out.skipped == 2
    [ev] = out.events
    assert isinstance(ev, Stored)
    assert ev.extra is not None


def test_decoded_events_feed_the_index() -> None:
    first = batch([block_stored([H1, H2])])
    second = batch([["BlockStored", [3, 4], H2, TOKENS[8:16], 4, None, "GPU"]])
    index = KvIndex()
    for payload in (first, second):
        index.apply("a", decode(payload).events)
    assert index.match(chain_keys(TOKENS, 4), ["a"]) == {"a": 4}
    index.apply("a", decode(batch([block_removed([H2])])).events)
    assert index.match(chain_keys(TOKENS, 4), ["a"]) == {"a": 1}
    index.apply("a", decode(batch([CLEARED])).events)
    assert index.blocks("a") == 0


# -- what cannot be read is counted, never raised -------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", b"not msgpack at all \xff\xfe", batch([CLEARED]) + b"\x00", b"\x92\x01"],
)
def test_bytes_that_are_not_msgpack_are_undecodable(payload: bytes) -> None:
    out = decode(payload)
    assert out.problems == {"undecodable": 1}
    assert out.events == []


@pytest.mark.parametrize(
    "doc",
    [
        {"ts": 1.0, "events": []},  # a map, not a batch
        [1.0],
        [1.0, "events"],
        [1.0, {"type": "AllBlocksCleared"}],
        "a string",
        42,
        None,
    ],
)
def test_a_document_that_is_not_a_batch_is_counted(doc: Any) -> None:
    out = decode(msgspec.msgpack.encode(doc))
    assert out.problems == {"not_a_batch": 1}
    assert out.events == []


def test_unknown_events_are_counted_and_the_rest_decoded() -> None:
    events = [
        {"type": "BlockPinned", "block_hashes": [1]},
        {"block_hashes": [1]},  # no type at all
        ["BlockPinned", [1]],
        42,
        [],
        [1, 2],
        None,
        CLEARED,
    ]
    out = decode(batch(events))
    assert out.problems == {"unknown_event_type": 3, "unknown_event_shape": 4}
    assert out.events == [Cleared()]


@pytest.mark.parametrize(
    "bad",
    [
        block_stored([[1, 2]]),  # hashes that are lists
        block_stored([1, [2]]),
        block_stored([1.5]),
        block_stored("abc"),  # type: ignore[arg-type]
        block_stored([1], parent=[0]),
        block_stored([1], parent=1.0),
        block_stored([1], tokens=None) | {"token_ids": None},
        block_stored([1], block_size=0),
        block_stored([1], block_size=-4),
        block_stored([1], block_size="4"),
        {"type": "BlockStored"},
        ["BlockStored", [[1]], None, TOKENS[:4], 4, None, "GPU"],
        ["BlockStored"],
    ],
)
def test_a_malformed_block_stored_is_counted_and_the_rest_decoded(bad: Any) -> None:
    out = decode(batch([bad, block_removed([9]), CLEARED]))
    assert out.problems == {"malformed_block_stored": 1}
    assert out.events == [Removed([9]), Cleared()]


@pytest.mark.parametrize(
    "bad",
    [
        block_removed([[1]]),
        block_removed([1, [2, 3]]),
        block_removed(None),  # type: ignore[arg-type]
        {"type": "BlockRemoved"},
        ["BlockRemoved", [{"h": 1}]],
        ["BlockRemoved"],
    ],
)
def test_a_malformed_block_removed_is_counted_and_the_rest_decoded(bad: Any) -> None:
    out = decode(batch([block_stored([1]), bad]))
    assert out.problems == {"malformed_block_removed": 1}
    assert out.events == [Stored([1], None, TOKENS[:4], 4)]


def test_problems_of_each_kind_add_up_in_one_batch() -> None:
    events = [block_stored([[1]]), block_stored([[2]]), block_removed([[3]]), 7, CLEARED]
    out = decode(batch(events))
    assert out.problems == {
        "malformed_block_stored": 2,
        "malformed_block_removed": 1,
        "unknown_event_shape": 1,
    }
    assert out.events == [Cleared()]


def test_a_deeply_nested_payload_is_counted_not_raised() -> None:
    payload = b"\x91" * 5000 + b"\xc0"  # [[[...[nil]...]]]
    out = decode(payload)
    assert out.problems == {"undecodable": 1}


def test_token_ids_that_are_not_ints_are_counted_malformed() -> None:
    bad = block_stored([1], tokens=[[1], [2], [3], [4]])
    out = decode(batch([bad, CLEARED]))
    assert out.problems == {"malformed_block_stored": 1}
    KvIndex().apply("a", out.events)  # must not raise whatever decode let through


def test_blocks_before_the_first_extra_key_keep_their_plain_keys() -> None:
    index = KvIndex()
    # A text prompt: two blocks cached plainly.
    index.apply("a", decode(batch([block_stored([1, 2])])).events)
    assert index.match(chain_keys(TOKENS, 4), ["a"]) == {"a": 2}
    # A request with the same two text blocks and an image in its third block: vLLM reports
    # the hit on blocks 1 and 2 and the new block 3 with extra keys for block 3 only.
    with_image = block_stored([1, 2, 3], tokens=TOKENS[:12], extra_keys=[None, None, [["img", 0]]])
    index.apply("a", decode(batch([with_image])).events)
    assert index.match(chain_keys(TOKENS, 4), ["a"]) == {"a": 2}


# -- sequence numbers ------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 42, 2**40, 2**63 - 1])
def test_seq_of_reads_the_big_endian_counter(n: int) -> None:
    assert seq_of(n.to_bytes(8, "big")) == n


def test_seq_of_the_replay_end_marker_is_minus_one() -> None:
    assert seq_of(b"\xff" * 8) == END_SEQ == -1
    assert seq_of((-1).to_bytes(8, "big", signed=True)) == END_SEQ


# -- what vLLM itself sends ------------------------------------------------------------------

_ENCODE_WITH_VLLM = textwrap.dedent(
    """
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
    )

    tokens = list(range(100, 116))
    events = [
        BlockStored(
            block_hashes=[b"\\x01" * 32, b"\\x02" * 32], parent_block_hash=None,
            token_ids=tokens[:8], block_size=4, lora_id=None, medium="GPU", lora_name=None,
        ),
        BlockStored(
            block_hashes=[3, 4], parent_block_hash=b"\\x02" * 32, token_ids=tokens[8:16],
            block_size=4, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
        ),
        BlockStored(
            block_hashes=[5], parent_block_hash=None, token_ids=tokens[:4], block_size=4,
            lora_id=None, medium="CPU", lora_name=None,
        ),
        BlockStored(
            block_hashes=[6], parent_block_hash=None, token_ids=tokens[:4], block_size=4,
            lora_id=None, medium="GPU", lora_name=None, group_idx=1,
        ),
        BlockStored(
            block_hashes=[7], parent_block_hash=None, token_ids=tokens[:4], block_size=4,
            lora_id=1, medium="GPU", lora_name="adapter",
        ),
        BlockRemoved(block_hashes=[4], medium="GPU"),
        BlockRemoved(block_hashes=[5], medium="CPU"),
        AllBlocksCleared(),
    ]
    batch = KVEventBatch(ts=1234.5, events=events, data_parallel_rank=1)
    print(msgspec.msgpack.Encoder().encode(batch).hex())
    """
)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(200)  # vLLM's first import after its install took over 50 s here once
def test_a_batch_encoded_by_vllm_itself_is_decoded(tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} to encode a batch with")
    run = subprocess.run(
        [str(VLLM_PYTHON), "-c", _ENCODE_WITH_VLLM],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    payload = bytes.fromhex(run.stdout.strip().splitlines()[-1])
    out = decode(payload)
    assert out.problems == {}
    assert out.form == "tagged"
    assert out.ts == 1234.5
    assert out.rank == 1
    assert out.skipped == 3  # the CPU store and removal, the group-1 store
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    assert out.events[:2] == [
        Stored([h1, h2], None, TOKENS[:8], 4),
        Stored([3, 4], h2, TOKENS[8:16], 4),
    ]
    lora = out.events[2]
    assert isinstance(lora, Stored)
    assert lora.hashes == [7]
    assert lora.extra is not None
    assert out.events[3:] == [Removed([4]), Cleared()]
    index = KvIndex()
    index.apply("a", out.events[:2])
    assert index.match(chain_keys(TOKENS, 4), ["a"]) == {"a": 4}
    index.apply("a", out.events[2:4])
    assert index.match(chain_keys(TOKENS, 4), ["a"]) == {"a": 3}
    index.apply("a", out.events[4:])
    assert index.blocks("a") == 0
