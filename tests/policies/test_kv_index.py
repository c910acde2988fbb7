"""KvIndex: what each backend's engine caches, kept from its KV events under our own keys."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.kv_index import (
    ROOT,
    CacheStats,
    Cleared,
    EngineHash,
    KvIndex,
    Removed,
    Stored,
    cacheable_blocks,
    chain_keys,
)

BS = 4
PROMPT = tuple(range(100, 124))  # six blocks of four tokens
ROOT_DIR = Path(__file__).resolve().parents[2]


def stored(
    tokens: Sequence[int],
    hashes: Sequence[EngineHash],
    parent: EngineHash | None = None,
    bs: int = BS,
    extra: object = None,
) -> Stored:
    return Stored(
        hashes=list(hashes), parent=parent, tokens=list(tokens), block_size=bs, extra=extra
    )


def keys(tokens: Sequence[int] = PROMPT, bs: int = BS) -> list[int]:
    return chain_keys(tokens, bs)


# -- chain_keys and cacheable_blocks ---------------------------------------------------------


def test_a_blocks_key_depends_on_every_token_before_it() -> None:
    base = keys()
    assert len(base) == 6
    assert len(set(base)) == 6
    first = keys((999, *PROMPT[1:]))
    assert not set(first) & set(base)  # a change in block 0 changes every key
    third = keys((*PROMPT[:9], 999, *PROMPT[10:]))
    assert third[:2] == base[:2]
    assert not set(third[2:]) & set(base)
    # Block 3's tokens after another beginning do not give block 3's key.
    assert keys(PROMPT[12:16])[0] != base[3]


def test_only_full_blocks_are_keyed_up_to_the_limit() -> None:
    assert keys(PROMPT[:11]) == keys()[:2]
    assert chain_keys(PROMPT, BS, limit=3) == keys()[:3]
    assert chain_keys(PROMPT, BS, limit=0) == []
    assert chain_keys((), BS) == []
    assert chain_keys(PROMPT[:3], BS) == []


def test_keys_are_the_same_for_a_list_or_a_tuple_and_chain_from_root() -> None:
    assert chain_keys(list(PROMPT), BS) == chain_keys(PROMPT, BS)
    assert keys()[0] == hash((ROOT, *PROMPT[:4]))
    assert keys()[1] == hash((keys()[0], *PROMPT[4:8]))


@pytest.mark.parametrize("bs", [0, -4])
def test_chain_keys_rejects_a_block_size_that_is_not_positive(bs: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        chain_keys(PROMPT, bs)


def test_keys_are_the_same_in_every_process() -> None:
    code = (
        "import json; from policies.kv_index import chain_keys; "
        "print(json.dumps(chain_keys(list(range(100, 164)), 16)))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=ROOT_DIR,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2", "random")
    }
    assert len(outputs) == 1
    assert json.loads(outputs.pop()) == chain_keys(list(range(100, 164)), 16)


@pytest.mark.parametrize(
    ("tokens", "bs", "blocks"),
    [(0, 16, 0), (1, 16, 0), (16, 16, 0), (17, 16, 1), (32, 16, 1), (33, 16, 2), (9, 4, 2)],
)
def test_the_last_token_is_never_served_from_cache(tokens: int, bs: int, blocks: int) -> None:
    assert cacheable_blocks(tokens, bs) == blocks


# -- Stored ----------------------------------------------------------------------------------


def test_a_run_stored_from_the_root_is_matched() -> None:
    index = KvIndex()
    index.apply("a", [stored(PROMPT[:12], [1, 2, 3])])
    assert index.match(keys(), ["a"]) == {"a": 3}
    assert index.blocks("a") == 3
    assert index.block_size("a") == BS
    assert index.stats()["a"] == CacheStats(3, BS, 3, 0, 0, 0)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ([11, 12], [13, 14]),
        ([b"\x01" * 32, b"\x02" * 32], [b"\x03" * 32, b"\x04" * 32]),
        ([11, 12], [b"\x03" * 32, b"\x04" * 32]),  # hashes of another kind, same chain
    ],
)
def test_a_run_chained_on_a_parent_stored_earlier_continues_its_prefix(
    first: list[EngineHash], second: list[EngineHash]
) -> None:
    index = KvIndex()
    index.apply("a", [stored(PROMPT[:8], first)])
    index.apply("a", [stored(PROMPT[8:16], second, parent=first[-1])])
    assert index.match(keys(), ["a"]) == {"a": 4}
    # Chained on the first block instead: the second block of the run is new, the rest not
    # a prefix of PROMPT.
    index.apply("a", [stored((7, 7, 7, 7), [99], parent=first[0])])
    other = keys((*PROMPT[:4], 7, 7, 7, 7))
    assert index.match(other, ["a"]) == {"a": 2}
    assert index.blocks("a") == 5


def test_a_block_under_an_unknown_parent_is_not_indexed_but_counted() -> None:
    index = KvIndex()
    index.apply("a", [stored(PROMPT[:8], [1, 2])])
    index.apply("a", [stored(PROMPT[8:16], [3, 4], parent=77)])  # 77: an event missed
    assert index.match(keys(), ["a"]) == {"a": 2}
    assert index.blocks("a") == 2
    stats = index.stats()["a"]
    assert stats.orphans == 2
    assert stats.stored == 2
    # A child of an orphan is an orphan too.
    index.apply("a", [stored(PROMPT[16:20], [5], parent=4)])
    assert index.stats()["a"].orphans == 3


@pytest.mark.parametrize(
    "event",
    [
        Stored(hashes=[1, 2], parent=None, tokens=list(PROMPT[:7]), block_size=BS),  # too few
        Stored(hashes=[1], parent=None, tokens=list(PROMPT[:4]), block_size=0),
    ],
)
def test_a_malformed_run_is_counted_and_not_indexed(event: Stored) -> None:
    index = KvIndex()
    index.apply("a", [event])
    assert index.blocks("a") == 0
    assert index.stats()["a"].orphans == len(event.hashes)
    assert index.block_size("a") is None


def test_a_hash_stored_again_with_other_tokens_replaces_its_old_key() -> None:
    index = KvIndex()
    index.apply("a", [stored(PROMPT[:4], [1])])
    other = (9, 9, 9, 9)
    index.apply("a", [stored(other, [1])])  # the engine reused hash 1 for another block
    assert index.match(keys(), ["a"]) == {"a": 0}
    assert index.match(keys(other), ["a"]) == {"a": 1}
    assert index.blocks("a") == 1
    assert index.size == 1
    # Removing it now removes the new block.
    index.apply("a", [Removed([1])])
    assert index.match(keys(other), ["a"]) == {"a": 0}
    assert index.blocks("a") == 0


def test_a_block_stored_again_unchanged_is_held_once() -> None:
    index = KvIndex()
    index.apply("a", [stored(PROMPT[:8], [1, 2])])
    index.apply("a", [stored(PROMPT[:8], [1, 2])])  # a prefix-cache hit reported again
    assert index.blocks("a") == 2
    assert index.size == 2
    index.apply("a", [Removed([2])])
    assert index.match(keys(), ["a"]) == {"a": 1}


def test_a_key_held_under_two_engine_hashes_stays_until_both_are_removed() -> None:
    index = KvIndex()
    # The same tokens under two hashes (say, an engine restart whose clear was missed).
    index.apply("a", [stored(PROMPT[:4], [1]), stored(PROMPT[:4], [b"one"])])
    assert index.blocks("a") == 1
    assert index.size == 2
    index.apply("a", [Removed([1])])
    assert index.match(keys(), ["a"]) == {"a": 1}
    index.apply("a", [Removed([b"one"])])
    assert index.match(keys(), ["a"]) == {"a": 0}


def test_extra_blocks_never_match_plain_keys() -> None:
    index = KvIndex()
    index.apply("a", [stored(PROMPT[:8], [1, 2], extra=("lora", "adapter"))])
    index.apply("a", [stored(PROMPT[8:12], [3], parent=2)])  # chained on an extra block
    assert index.blocks("a") == 3
    assert index.match(keys(), ["a"]) == {"a": 0}
    index.apply("b", [stored(PROMPT[:8], [1, 2], extra=("salt", "s"))])
    index.apply("b", [stored(PROMPT[:8], [5, 6])])
    assert index.match(keys(), ["a", "b"]) == {"a": 0, "b": 2}


# -- Removed, Cleared, clear, forget ---------------------------------------------------------


def test_a_removed_block_is_no_longer_matched() -> None:
    index = KvIndex()
    index.apply("a", [stored(PROMPT[:12], [1, 2, 3])])
    index.apply("a", [Removed([3])])
    assert index.match(keys(), ["a"]) == {"a": 2}
    # The first block gone: the rest is unreachable, as in the engine's own lookup.
    index.apply("a", [Removed([1])])
    assert index.match(keys(), ["a"]) == {"a": 0}
    assert index.blocks("a") == 1
    assert index.stats()["a"].removed == 2


def test_removing_an_unknown_hash_changes_nothing() -> None:
    index = KvIndex()
    index.apply("a", [stored(PROMPT[:8], [1, 2])])
    index.apply("a", [Removed([42, b"nope"])])
    assert index.match(keys(), ["a"]) == {"a": 2}
    assert index.stats()["a"].removed == 0


def test_a_block_removed_from_one_backend_stays_in_another() -> None:
    index = KvIndex()
    index.apply("a", [stored(PROMPT[:8], [1, 2])])
    index.apply("b", [stored(PROMPT[:8], [1, 2])])  # same engine hashes, another engine
    index.apply("a", [Removed([2])])
    assert index.match(keys(), ["a", "b"]) == {"a": 1, "b": 2}
    index.apply("a", [Cleared()])
    assert index.match(keys(), ["a", "b"]) == {"a": 0, "b": 2}


def test_cleared_drops_everything_the_backend_holds_and_keeps_its_counters() -> None:
    index = KvIndex()
    index.apply("a", [stored(PROMPT[:8], [1, 2]), Cleared(), stored((5, 5, 5, 5), [3])])
    assert index.match(keys(), ["a"]) == {"a": 0}
    assert index.match(keys((5, 5, 5, 5)), ["a"]) == {"a": 1}
    assert index.stats()["a"] == CacheStats(1, BS, 3, 0, 0, 0)
    index.clear("a")
    assert index.blocks("a") == 0
    assert index.size == 0
    assert index.stats()["a"].stored == 3
    # Events after the clear chain on nothing they do not name.
    index.apply("a", [stored(PROMPT[8:12], [4], parent=2)])
    assert index.stats()["a"].orphans == 1
    index.clear("never-seen")  # no-op
    assert "never-seen" not in index.stats()


def test_forget_drops_the_backend_entirely() -> None:
    index = KvIndex()
    index.set_live("a", True)
    index.apply("a", [stored(PROMPT[:8], [1, 2])])
    index.forget("a")
    assert not index.exact("a")
    assert "a" not in index.stats()
    assert index.block_size("a") is None
    assert index.match(keys(), ["a"]) == {"a": 0}
    assert index.size == 0
    index.forget("a")  # again: no-op


def test_a_forgotten_backends_bit_is_reused_without_its_old_blocks() -> None:
    index = KvIndex()
    index.apply("a", [stored(PROMPT[:12], [1, 2, 3])])
    index.apply("b", [stored(PROMPT[:4], [1])])
    index.forget("a")
    # c takes a's place in the bitmasks: it must not inherit what a held.
    index.apply("c", [stored((8, 8, 8, 8), [1])])
    assert index.match(keys(), ["b", "c"]) == {"b": 1, "c": 0}
    assert index.match(keys((8, 8, 8, 8)), ["b", "c"]) == {"b": 0, "c": 1}
    # And a coming back starts empty, with yet another bit or a's old one.
    index.apply("a", [stored((6, 6, 6, 6), [9])])
    assert index.match(keys(), ["a", "b", "c"]) == {"a": 0, "b": 1, "c": 0}
    # Removing c's block does not touch b's key.
    index.apply("c", [Removed([1])])
    assert index.match(keys(), ["b", "c"]) == {"b": 1, "c": 0}


def test_many_forgotten_and_new_backends_keep_the_bitmasks_exact() -> None:
    index = KvIndex()
    index.apply("keeper", [stored(PROMPT[:8], [1, 2])])
    for gen in range(20):
        name = f"gen{gen}"
        index.apply(name, [stored(PROMPT[: 4 * (gen % 3 + 1)], [1, 2, 3][: gen % 3 + 1])])
        assert index.match(keys(), [name, "keeper"]) == {name: gen % 3 + 1, "keeper": 2}
        index.forget(name)
    index.apply("fresh", [stored((1, 1, 1, 1), [1])])
    assert index.match(keys(), ["fresh", "keeper"]) == {"fresh": 0, "keeper": 2}


# -- match -----------------------------------------------------------------------------------


def test_match_counts_leading_keys_per_backend_stopping_at_the_first_miss() -> None:
    index = KvIndex()
    index.apply("a", [stored(PROMPT[:24], [1, 2, 3, 4, 5, 6])])
    index.apply("b", [stored(PROMPT[:12], [1, 2, 3])])
    index.apply("c", [stored(PROMPT[:16], [1, 2, 3, 4]), Removed([2])])  # a hole at block 1
    index.apply("d", [stored(PROMPT[:4], [1])])
    index.apply("e", [stored((3, 3, 3, 3), [1])])  # holds something else
    index.apply("f", [stored(PROMPT[:4], [1]), Cleared()])  # known, empty
    everyone = ["a", "b", "c", "d", "e", "f", "stranger"]
    assert index.match(keys(), everyone) == {
        "a": 6,
        "b": 3,
        "c": 1,
        "d": 1,
        "e": 0,
        "f": 0,
        "stranger": 0,
    }
    # Only the backends asked about are answered.
    assert index.match(keys(), ["b"]) == {"b": 3}
    assert index.match(keys()[:2], ["a", "b"]) == {"a": 2, "b": 2}
    assert index.match([], ["a", "b"]) == {"a": 0, "b": 0}
    assert index.match(keys(), []) == {}


def test_match_of_a_backend_it_never_heard_of_is_zero() -> None:
    index = KvIndex()
    assert index.match(keys(), ["x", "y"]) == {"x": 0, "y": 0}
    assert index.blocks("x") == 0
    assert index.block_size("x") is None
    assert index.stats() == {}


# -- capacity --------------------------------------------------------------------------------


def test_past_capacity_the_oldest_stored_blocks_are_dropped() -> None:
    index = KvIndex(capacity=4)
    one, two, three = (1,) * 8, (2,) * 8, (3,) * 8
    index.apply("a", [stored(one, [11, 12])])
    index.apply("a", [stored(two, [21, 22])])
    index.apply("a", [stored(three, [31, 32])])
    assert index.match(keys(one), ["a"]) == {"a": 0}
    assert index.match(keys(two), ["a"]) == {"a": 2}
    assert index.match(keys(three), ["a"]) == {"a": 2}
    assert index.size == 4
    assert index.stats()["a"] == CacheStats(4, BS, 6, 0, 0, 2)
    # Removing an evicted block is not a removal.
    index.apply("a", [Removed([11])])
    assert index.stats()["a"].removed == 0


def test_a_block_stored_again_is_the_last_to_be_evicted() -> None:
    index = KvIndex(capacity=4)
    one, two, three = (1,) * 8, (2,) * 8, (3,) * 8
    index.apply("a", [stored(one, [11, 12]), stored(two, [21, 22])])
    index.apply("a", [stored(one, [11, 12])])  # reused: refreshed
    index.apply("a", [stored(three, [31, 32])])
    assert index.match(keys(one), ["a"]) == {"a": 2}
    assert index.match(keys(two), ["a"]) == {"a": 0}


def test_capacity_is_per_backend_and_size_counts_them_all() -> None:
    index = KvIndex(capacity=3)
    index.apply("a", [stored(PROMPT[:16], [1, 2, 3, 4])])
    index.apply("b", [stored(PROMPT[:8], [1, 2])])
    assert index.size == 5
    assert index.stats()["a"].evicted == 1
    assert index.stats()["b"].evicted == 0
    assert index.stats()["a"].blocks == 3
    # a lost its first block (the oldest): its prefix is gone, b's is not.
    assert index.match(keys(), ["a", "b"]) == {"a": 0, "b": 2}


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        KvIndex(capacity=0)


# -- live ------------------------------------------------------------------------------------


def test_a_backend_is_exact_only_while_live() -> None:
    index = KvIndex()
    assert not index.exact("a")
    index.set_live("a", True)
    assert index.exact("a")
    assert not index.exact("b")
    index.set_live("a", True)
    index.set_live("a", False)
    assert not index.exact("a")
    index.set_live("a", False)  # not live already: no-op
    assert not index.exact("a")
    # Being live does not depend on holding anything, nor clearing on being live.
    index.set_live("a", True)
    index.apply("a", [stored(PROMPT[:4], [1])])
    index.clear("a")
    assert index.exact("a")


# -- against a naive model -------------------------------------------------------------------

BACKENDS = ("a", "b", "c")
SIZES = {"a": 2, "b": 2, "c": 3}
HASHES: list[EngineHash] = [0, 1, 2, 3, 4, 5, b"\x00", b"\x01", b"\x02" * 32]
_token = st.integers(0, 1)  # few distinct blocks: keys collide across engine hashes


def _tokens_for(backend: str, n: int) -> st.SearchStrategy[list[int]]:
    size = n * SIZES[backend]
    return st.lists(_token, min_size=size, max_size=size)


@st.composite
def _op(draw: st.DrawFn) -> tuple[object, ...]:
    kind = draw(
        st.sampled_from(["store", "store", "store", "remove", "cleared", "clear", "forget"])
    )
    backend = draw(st.sampled_from(BACKENDS))
    if kind == "store":
        hashes = draw(st.lists(st.sampled_from(HASHES), min_size=1, max_size=3))
        parent = draw(st.none() | st.sampled_from(HASHES))
        return (kind, backend, hashes, parent, draw(_tokens_for(backend, len(hashes))))
    if kind == "remove":
        return (kind, backend, draw(st.lists(st.sampled_from(HASHES), min_size=1, max_size=3)))
    return (kind, backend)


class _Model:
    """Per backend: engine hash -> (our key, the tokens of the prefix it names)."""

    def __init__(self) -> None:
        self.held: dict[str, dict[EngineHash, tuple[int, tuple[int, ...]]]] = {}
        self.orphans: dict[str, int] = {}

    def apply(self, op: tuple[object, ...]) -> None:
        kind, backend = op[0], op[1]
        assert isinstance(backend, str)
        held = self.held.setdefault(backend, {})
        if kind == "store":
            _, _, hashes, parent, tokens = op
            assert isinstance(hashes, list)
            assert isinstance(tokens, list)
            path: tuple[int, ...]
            if parent is None:
                prev, path = ROOT, ()
            elif parent in held:
                prev, path = held[parent]
            else:
                self.orphans[backend] = self.orphans.get(backend, 0) + len(hashes)
                return
            bs = SIZES[backend]
            for j, h in enumerate(hashes):
                block = tuple(tokens[j * bs : (j + 1) * bs])
                prev, path = hash((prev, *block)), path + block
                held[h] = (prev, path)
        elif kind == "remove":
            hashes = op[2]
            assert isinstance(hashes, list)
            for h in hashes:
                held.pop(h, None)
        elif kind in ("cleared", "clear"):
            held.clear()
        else:
            del self.held[backend]
            self.orphans.pop(backend, None)

    def match(self, tokens: Sequence[int], backend: str) -> int:
        have = {key for key, _ in self.held.get(backend, {}).values()}
        n = 0
        for key in chain_keys(tokens, SIZES[backend]):
            if key not in have:
                break
            n += 1
        return n


def _apply(index: KvIndex, op: tuple[object, ...]) -> None:
    kind, backend = op[0], op[1]
    assert isinstance(backend, str)
    if kind == "store":
        _, _, hashes, parent, tokens = op
        assert isinstance(hashes, list)
        assert isinstance(tokens, list)
        index.apply(backend, [Stored(hashes, parent, tokens, SIZES[backend])])
    elif kind == "remove":
        hashes = op[2]
        assert isinstance(hashes, list)
        index.apply(backend, [Removed(hashes)])
    elif kind == "cleared":
        index.apply(backend, [Cleared()])
    elif kind == "clear":
        index.clear(backend)
    else:
        index.forget(backend)


@settings(max_examples=300, deadline=None, database=None)  # nothing written to the tree
@given(
    ops=st.lists(_op(), min_size=8, max_size=60),
    probes=st.lists(st.lists(_token, max_size=9), max_size=4),
)
def test_the_index_agrees_with_a_naive_model(
    ops: list[tuple[object, ...]], probes: list[list[int]]
) -> None:
    index = KvIndex(capacity=10_000)
    model = _Model()
    seen: set[tuple[int, ...]] = set()
    for op in ops:
        _apply(index, op)
        model.apply(op)
        # Probe with every prefix ever held (so stale keys show), extended, and random tokens.
        seen.update(path for held in model.held.values() for _, path in held.values())
        queries = [list(p) for p in seen] + [[*p, 0, 1, 2] for p in seen] + probes
        for tokens in queries:
            for bs in sorted(set(SIZES.values())):
                group = [b for b in BACKENDS if SIZES[b] == bs]
                expected = {b: model.match(tokens, b) for b in group}
                assert index.match(chain_keys(tokens, bs), group) == expected
        for b in BACKENDS:
            held = model.held.get(b)
            assert index.blocks(b) == len({key for key, _ in (held or {}).values()})
            assert index.stats().get(b, CacheStats(0, None, 0, 0, 0, 0)).orphans == (
                model.orphans.get(b, 0)
            )
        assert index.size == sum(len(h) for h in model.held.values())
