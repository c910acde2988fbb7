"""Prompt block hashing and the bounded prefix index, as plain function calls."""

from __future__ import annotations

import subprocess
import sys

import pytest

from policies import PrefixHasher, PrefixIndex
from policies.prefix import KEY_BLOCKS, PrefixHeat, chain_hashes, prompt_text, stable_key


def test_the_same_text_always_gives_the_same_hashes() -> None:
    text = "abcdefgh" * 40
    assert chain_hashes(text, 16, seed="m") == chain_hashes(text, 16, seed="m")
    assert len(chain_hashes(text, 16, seed="m")) == 20


def test_shared_prefix_shares_exactly_its_leading_hashes() -> None:
    common = "s" * 48  # three 16-char blocks
    a = chain_hashes(common + "a" * 32, 16)
    b = chain_hashes(common + "b" * 32, 16)
    assert a[:3] == b[:3]
    assert a[3] != b[3]
    # Chained: the same block text after a different beginning hashes differently.
    c = chain_hashes("x" * 16 + common[16:] + "a" * 32, 16)
    assert c[0] != a[0]
    assert not set(c) & set(a)


def test_only_full_blocks_are_hashed_and_the_seed_separates_models() -> None:
    assert chain_hashes("a" * 15, 16) == ()
    assert len(chain_hashes("a" * 33, 16)) == 2
    assert chain_hashes("a" * 32, 16, seed="m1") != chain_hashes("a" * 32, 16, seed="m2")


def test_hasher_caps_the_blocks_hashed() -> None:
    hasher = PrefixHasher(block_chars=10, max_blocks=3)
    assert len(hasher.facts("m", {"prompt": "z" * 1000})[0]) == 3


def test_chat_messages_render_in_order_with_role_and_content() -> None:
    doc = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
        ]
    }
    text = prompt_text(doc, 1000)
    assert text.index("system") < text.index("be brief") < text.index("user") < text.index("hi")
    # The role is part of the prefix: the same words said by someone else are another prompt.
    other = prompt_text({"messages": [{"role": "user", "content": "be brief"}]}, 1000)
    assert not text.startswith(other[:10])


def test_completion_prompts_batches_and_token_ids() -> None:
    assert prompt_text({"prompt": "hello"}, 100) == "hello"
    assert prompt_text({"prompt": ["first", "second"]}, 100) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}, 100) == "1 2 3"
    assert prompt_text({"prompt": "x" * 50}, 10) == "x" * 10
    assert prompt_text({"input": "nothing to hash"}, 100) == ""


def test_index_matches_the_longest_prefix_each_backend_received() -> None:
    idx = PrefixIndex(100)
    idx.record("a", [1, 2, 3, 4])
    idx.record("b", [1, 2, 9])
    assert idx.match([1, 2, 3, 4, 5], ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 0}
    assert idx.match([7, 2, 3], ["a", "b"]) == {"a": 0, "b": 0}
    assert idx.holders(1) == ("a", "b")
    assert idx.refs == 7
    assert len(idx) == 5


def test_index_is_bounded_and_evicts_the_least_recently_used() -> None:
    idx = PrefixIndex(6)
    idx.record("a", [1, 2, 3])
    idx.record("b", [10, 11, 12])
    idx.record("a", [1, 2, 3])  # touched again: now the most recent
    idx.record("c", [20, 21, 22])  # evicts b's blocks, not a's
    assert len(idx) == 6
    assert idx.match([10, 11, 12], ["b"]) == {"b": 0}
    assert idx.match([1, 2, 3], ["a"]) == {"a": 3}
    assert idx.match([20, 21, 22], ["c"]) == {"c": 3}
    assert idx.refs == 6
    assert idx.approx_bytes > 0


def test_a_prompts_tail_is_evicted_before_its_shared_beginning() -> None:
    idx = PrefixIndex(4)
    idx.record("a", [1, 2, 3, 4])
    idx.record("a", [9, 9 + 1])  # two new blocks push out two old ones: the tail, 3 and 4
    assert idx.match([1, 2, 3, 4], ["a"]) == {"a": 2}


def test_resize_evicts_down_to_the_new_capacity() -> None:
    idx = PrefixIndex(10)
    idx.record("a", list(range(10)))
    idx.resize(3)
    assert len(idx) == 3
    assert idx.match(list(range(10)), ["a"]) == {"a": 3}
    with pytest.raises(ValueError, match="capacity"):
        idx.resize(0)


def test_footprint_counts_the_blocks_each_backend_is_believed_to_hold() -> None:
    idx = PrefixIndex(5)
    idx.record("a", [1, 2, 3])
    idx.record("b", [1, 2])
    idx.record("a", [1, 2, 3])  # nothing new for a
    assert (idx.footprint("a"), idx.footprint("b"), idx.footprint("c")) == (3, 2, 0)
    idx.record("b", [7, 8, 9])  # six hashes: the oldest, 3 (a's only), goes
    assert (idx.footprint("a"), idx.footprint("b")) == (2, 5)
    idx.resize(1)  # the most recent, 7 (recorded tail first), is left
    assert (idx.footprint("a"), idx.footprint("b")) == (0, 1)
    assert idx.refs == 1


def test_heat_is_a_prefixs_share_of_recent_decisions() -> None:
    heat = PrefixHeat(window=100)
    shares = [heat.observe(1 if i % 2 == 0 else None) for i in range(40)]
    assert shares[-2] == pytest.approx(0.5, abs=0.03)  # prefix 1: every other decision
    assert heat.observe(2) == pytest.approx(1 / 41)


def test_heat_forgets_what_stopped_arriving() -> None:
    heat = PrefixHeat(window=10)
    for _ in range(10):
        heat.observe(1)  # all of the first window
    for _ in range(60):
        heat.observe(2)
    assert len(heat) == 1  # 1's count halved below a quarter and was dropped
    assert heat.observe(1) < 0.1
    with pytest.raises(ValueError, match="window"):
        PrefixHeat(window=0)


def test_the_stable_key_is_the_same_in_every_process() -> None:
    code = "from policies.prefix import stable_key; print(stable_key('m', 'x' * 700, 64))"
    keys = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert keys == {str(stable_key("m", "x" * 700, 64))}


def test_the_stable_key_names_the_first_blocks_and_the_model() -> None:
    head = "h" * 64 * KEY_BLOCKS
    assert stable_key("m", head + "one", 64) == stable_key("m", head + "two", 64)
    assert stable_key("m", head, 64) != stable_key("m", "g" + head[1:], 64)
    assert stable_key("m", head, 64) != stable_key("n", head, 64)
    # A short prompt: its full blocks only.
    assert stable_key("m", "a" * 100, 64) == stable_key("m", "a" * 64 + "b" * 36, 64)


def test_hasher_facts_give_the_hashes_and_the_key() -> None:
    hasher = PrefixHasher(block_chars=16, max_blocks=4)
    hashes, key = hasher.facts("m", {"prompt": "p" * 40}, keyed=True)
    assert hashes == chain_hashes("p" * 40, 16, seed="m")
    assert key == stable_key("m", "p" * 40, 16)
    assert hasher.facts("m", {"prompt": "short"}, keyed=True) == ((), None)
