"""Splitting an alias between pools: weighted draws, sticky rendezvous hashing, validation."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from policies.rollout import WeightsError, check_weights, choose_pool

KEYS = [f"session-{i}" for i in range(4000)]


def test_draws_converge_to_the_weights() -> None:
    rng = random.Random(7)
    n = 20_000
    got = Counter(choose_pool({"v1": 95, "v2": 5}, None, rng) for _ in range(n))
    assert abs(got["v2"] / n - 0.05) < 0.006
    assert got["v1"] + got["v2"] == n


def test_a_zero_weight_pool_is_never_drawn_and_all_zero_is_none() -> None:
    rng = random.Random(1)
    assert {choose_pool({"a": 0, "b": 3}, None, rng) for _ in range(200)} == {"b"}
    assert {choose_pool({"a": 0, "b": 3}, k, rng) for k in KEYS[:200]} == {"b"}
    assert choose_pool({"a": 0}, None, rng) is None
    assert choose_pool({"a": 0}, "k", rng) is None


def test_sticky_keys_split_by_weight_and_stay_put() -> None:
    rng = random.Random(0)
    first = {k: choose_pool({"v1": 70, "v2": 30}, k, rng) for k in KEYS}
    share = sum(p == "v2" for p in first.values()) / len(KEYS)
    assert abs(share - 0.30) < 0.04
    assert first == {k: choose_pool({"v1": 70, "v2": 30}, k, rng) for k in KEYS}


def test_only_the_share_that_must_move_moves_when_weights_change() -> None:
    rng = random.Random(0)
    steps = [{"v1": 95, "v2": 5}, {"v1": 50, "v2": 50}, {"v1": 0, "v2": 100}]
    before = {k: choose_pool(steps[0], k, rng) for k in KEYS}
    after = {k: choose_pool(steps[1], k, rng) for k in KEYS}
    # Growing v2 moves keys only onto v2: every key already there stays.
    assert all(after[k] == "v2" for k in KEYS if before[k] == "v2")
    moved = sum(before[k] != after[k] for k in KEYS) / len(KEYS)
    assert abs(moved - 0.45) < 0.04
    # And shrinking it back returns exactly the keys that moved.
    assert before == {k: choose_pool(steps[0], k, rng) for k in KEYS}
    assert {choose_pool(steps[2], k, rng) for k in KEYS} == {"v2"}


def test_a_third_pool_takes_its_share_from_both_others_only() -> None:
    rng = random.Random(0)
    before = {k: choose_pool({"a": 50, "b": 50}, k, rng) for k in KEYS}
    after = {k: choose_pool({"a": 50, "b": 50, "c": 25}, k, rng) for k in KEYS}
    assert all(after[k] in (before[k], "c") for k in KEYS)
    assert abs(sum(p == "c" for p in after.values()) / len(KEYS) - 0.2) < 0.04


@pytest.mark.parametrize(
    ("weights", "why"),
    [
        ({}, "at least one"),
        ({"v3": 1}, "unknown pool"),
        ({"v1": -1, "v2": 2}, ">= 0"),
        ({"v1": float("nan")}, ">= 0"),
        ({"v1": "5"}, ">= 0"),
        ({"v1": True}, ">= 0"),
        ({"v1": 0, "v2": 0}, "all be 0"),
    ],
)
def test_bad_weights_are_refused(weights: dict[str, object], why: str) -> None:
    with pytest.raises(WeightsError, match=why):
        check_weights(weights, {"v1", "v2"})  # type: ignore[arg-type]


def test_good_weights_come_back_as_floats() -> None:
    assert check_weights({"v1": 95, "v2": 5}, {"v1", "v2"}) == {"v1": 95.0, "v2": 5.0}
