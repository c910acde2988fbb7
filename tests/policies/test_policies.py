"""Routing arithmetic and tie breaking, as plain function calls."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from policies import (
    BackendSnapshot,
    LeastLoad,
    PowerOfTwo,
    RandomChoice,
    RoundRobin,
    RouteFacts,
    Weights,
    make_policy,
    score,
)

FACTS = RouteFacts(model="m")


def snap(id_: str, in_flight: int = 0, **kw: object) -> BackendSnapshot:
    return BackendSnapshot(id=id_, in_flight=in_flight, **kw)  # type: ignore[arg-type]


def test_score_is_the_weighted_sum_of_in_flight_queue_and_kv() -> None:
    s = snap("a", in_flight=4, queue_depth=5, running=3, kv_cache_usage=0.5, sent_since_scrape=2)
    # 2 x 4 + 3 x (5 + 2) + 10 x 0.5
    assert score(s, Weights(active=2, queue=3, kv=10)) == 8 + 21 + 5


def test_default_weights_are_2_3_0() -> None:
    assert Weights() == Weights(active=2.0, queue=3.0, kv=0.0)
    s = snap("a", in_flight=1, queue_depth=1, kv_cache_usage=0.9)
    assert score(s, Weights()) == 2 + 3


def test_without_a_fresh_scrape_only_the_local_count_counts() -> None:
    stale = snap("a", in_flight=3, sent_since_scrape=7)  # queue_depth None: stale or never
    assert score(stale, Weights(active=2, queue=3, kv=5)) == 6


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_weights_reject_negative_or_nan(bad: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        Weights(active=bad)


def test_least_load_picks_the_lowest_score() -> None:
    p = LeastLoad()
    cands = [
        snap("busy", in_flight=1, queue_depth=4),
        snap("idle", in_flight=2, queue_depth=0),
        snap("mid", in_flight=0, queue_depth=2),
    ]
    # busy: 2 + 12 = 14, idle: 4, mid: 6
    assert p.choose(FACTS, cands).backend == cands[1]  # type: ignore[union-attr]


def test_queue_weight_changes_the_choice() -> None:
    cands = [snap("a", in_flight=2, queue_depth=0), snap("b", in_flight=0, queue_depth=2)]
    assert LeastLoad(weights=Weights(active=2, queue=3)).choose(FACTS, cands).backend.id == "a"  # type: ignore[union-attr]
    assert LeastLoad(weights=Weights(active=2, queue=1)).choose(FACTS, cands).backend.id == "b"  # type: ignore[union-attr]


def test_requests_sent_since_the_scrape_count_as_queue() -> None:
    # Both scraped idle; "a" has been sent 3 requests since its scrape: "b" wins.
    cands = [
        snap("a", in_flight=0, queue_depth=0, sent_since_scrape=3),
        snap("b", in_flight=0, queue_depth=0),
    ]
    assert LeastLoad().choose(FACTS, cands).backend.id == "b"  # type: ignore[union-attr]


def test_least_load_breaks_ties_at_random_never_first_in_list() -> None:
    p = LeastLoad(rng=random.Random(1))
    cands = [snap("a"), snap("b"), snap("c"), snap("d", in_flight=1)]
    counts = Counter(p.choose(FACTS, cands).backend.id for _ in range(3000))  # type: ignore[union-attr]
    assert set(counts) == {"a", "b", "c"}
    for k in "abc":
        assert 850 < counts[k] < 1150, counts


def test_empty_candidates_give_none() -> None:
    for p in (LeastLoad(), RoundRobin(), RandomChoice(), PowerOfTwo()):
        assert p.choose(FACTS, []) is None


def test_round_robin_cycles() -> None:
    p = RoundRobin()
    cands = [snap("a"), snap("b"), snap("c")]
    assert [p.choose(FACTS, cands).backend.id for _ in range(7)] == list("abcabca")  # type: ignore[union-attr]


def test_random_uses_every_candidate() -> None:
    p = RandomChoice(rng=random.Random(3))
    cands = [snap("a"), snap("b")]
    counts = Counter(p.choose(FACTS, cands).backend.id for _ in range(1000))  # type: ignore[union-attr]
    assert 400 < counts["a"] < 600


def test_power_of_two_takes_the_lower_of_two_distinct_samples() -> None:
    p = PowerOfTwo(rng=random.Random(5))
    cands = [snap("idle"), snap("busy", in_flight=10)]
    # With two candidates both are always sampled: the idle one always wins.
    assert {p.choose(FACTS, cands).backend.id for _ in range(200)} == {"idle"}  # type: ignore[union-attr]
    three = [snap("a"), snap("b", in_flight=5), snap("c", in_flight=9)]
    counts = Counter(p.choose(FACTS, three).backend.id for _ in range(3000))  # type: ignore[union-attr]
    # "c" loses every pair it is in; "a" wins both of its pairs: 2/3 of the draws.
    assert "c" not in counts
    assert 1850 < counts["a"] < 2150


def test_power_of_two_single_candidate() -> None:
    only = snap("a", in_flight=100)
    assert PowerOfTwo().choose(FACTS, [only]).backend is only  # type: ignore[union-attr]


def test_make_policy_by_name() -> None:
    w = Weights(active=1, queue=1)
    assert isinstance(make_policy("least_load", w), LeastLoad)
    assert make_policy("least_load", w).weights == w  # type: ignore[attr-defined]
    assert isinstance(make_policy("round_robin"), RoundRobin)
    assert isinstance(make_policy("random"), RandomChoice)
    assert isinstance(make_policy("power_of_two"), PowerOfTwo)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")  # type: ignore[arg-type]
