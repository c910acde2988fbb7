"""prefix_affinity's decisions on hand-built snapshots: affinity, the balance guard, sessions."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from policies import (
    AffinityConfig,
    BackendSnapshot,
    Decision,
    Outcome,
    PrefixAffinity,
    PrefixIndex,
    RouteFacts,
    Weights,
    make_policy,
)
from policies.prefix_affinity import rendezvous

PROMPT = (1, 2, 3, 4, 5, 6)  # block hashes of a prompt


def snap(id_: str, in_flight: int = 0, **kw: object) -> BackendSnapshot:
    return BackendSnapshot(id=id_, in_flight=in_flight, **kw)  # type: ignore[arg-type]


def facts(hashes: tuple[int, ...] = PROMPT, session: str | None = None) -> RouteFacts:
    return RouteFacts(model="m", session_key=session, prefix_hashes=hashes)


def policy(seed: int = 0, **config: object) -> PrefixAffinity:
    cfg = AffinityConfig(**{"balance_abs": 4.0, "balance_rel": 1.5, **config})  # type: ignore[arg-type]
    return PrefixAffinity(rng=random.Random(seed), config=cfg)


def test_when_load_is_balanced_the_longest_cached_prefix_wins() -> None:
    p = policy()
    p.index.record("b", PROMPT[:4])
    p.index.record("c", PROMPT[:2])
    cands = [snap("a", 1), snap("b", 2), snap("c", 0)]
    assert p.choose(facts(), cands).backend.id == "b"  # type: ignore[union-attr]
    assert p.decisions["prefix"] == 1


def test_the_choice_is_remembered_so_the_next_request_follows_it() -> None:
    p = policy()
    cands = [snap("a"), snap("b"), snap("c")]
    first = p.choose(facts(), cands)
    assert first is not None
    assert p.decisions["load"] == 1  # nobody held anything: least load, then chance
    for _ in range(10):
        assert p.choose(facts(), cands).backend == first.backend  # type: ignore[union-attr]
    assert p.index.match(PROMPT, [first.backend.id]) == {first.backend.id: len(PROMPT)}


def test_a_failed_attempt_withdraws_what_its_decision_recorded() -> None:
    """The decision carries the tentative record: settling it needs no lookup by the facts
    (here an equal but distinct object, as another request for the same prompt would be)."""
    p = policy()
    decision = p.choose(facts(), [snap("a"), snap("b")])
    assert decision is not None
    chosen = decision.backend.id
    assert p.index.match(PROMPT, [chosen]) == {chosen: len(PROMPT)}  # tentatively
    p.on_result(facts(), decision, Outcome(ok=False, error="unreachable"))
    assert p.index.match(PROMPT, [chosen]) == {chosen: 0}
    assert p.index.footprint(chosen) == 0


def test_a_successful_attempt_keeps_its_record_and_a_foreign_failure_withdraws_nothing() -> None:
    p = policy()
    decision = p.choose(facts(), [snap("a"), snap("b")])
    assert decision is not None
    chosen = decision.backend.id
    p.on_result(facts(), decision, Outcome(ok=True, status=200))
    # A decision this policy did not record (nothing tentative in it) fails: nothing to undo.
    p.on_result(facts(), Decision(decision.backend), Outcome(ok=False, error="unreachable"))
    assert p.index.match(PROMPT, [chosen]) == {chosen: len(PROMPT)}


def test_load_wins_past_both_thresholds() -> None:
    p = policy(balance_abs=4.0, balance_rel=1.5)
    p.index.record("b", PROMPT)
    # One more would put b 5 above the floor of 2 (> 4) and 7 > 2 x 1.5: overloaded, it
    # loses its affinity.
    cands = [snap("a", 2), snap("b", 6), snap("c", 3)]
    assert p.choose(facts(), cands).backend.id == "a"  # type: ignore[union-attr]
    assert p.decisions["balance"] == 1


@pytest.mark.parametrize(
    ("loads", "why"),
    [
        ((10, 13, 12), "one more puts it 4 above the floor: not more than balance_abs"),
        ((20, 29, 25), "one more puts it 10 above, but 30 is not more than 20 x 1.5"),
    ],
)
def test_affinity_holds_until_both_thresholds_are_passed(
    loads: tuple[int, int, int], why: str
) -> None:
    p = policy(balance_abs=4.0, balance_rel=1.5)
    p.index.record("b", PROMPT)
    cands = [snap(i, n) for i, n in zip("abc", loads, strict=True)]
    assert p.choose(facts(), cands).backend.id == "b", why  # type: ignore[union-attr]


def test_the_guard_can_run_on_the_load_score() -> None:
    p = policy(balance_on="score", balance_abs=10.0, balance_rel=1.0)
    p.index.record("b", PROMPT)
    # In-flight counts are equal, but b's scraped queue puts its score 12 above a's.
    cands = [snap("a", 1, queue_depth=0), snap("b", 1, queue_depth=4)]
    assert p.choose(facts(), cands).backend.id == "a"  # type: ignore[union-attr]
    assert p.decisions["balance"] == 1


def test_among_equal_matches_the_least_loaded_wins() -> None:
    p = policy()
    for b in "abc":
        p.index.record(b, PROMPT)
    cands = [snap("a", 3), snap("b", 1), snap("c", 2)]
    assert p.choose(facts(), cands).backend.id == "b"  # type: ignore[union-attr]


def test_a_prefix_one_backend_can_carry_stays_with_the_first_to_get_it() -> None:
    """A copy the guard once made elsewhere is not kept warm by routing there on load."""
    p = policy()
    for _ in range(50):
        p.heat.observe(None)  # other traffic: this prompt is a small share of it
    p.index.record("a", PROMPT)
    p.index.record("b", PROMPT)  # say, a request the guard sent to b while a was busy
    cands = [snap("a", 3), snap("b", 1), snap("c", 2)]
    for _ in range(5):
        assert p.choose(facts(), cands).backend.id == "a"  # type: ignore[union-attr]
    assert p.decisions["prefix"] == 5


def test_a_prefix_with_more_traffic_than_one_backend_spreads_over_its_holders() -> None:
    p = policy()
    for b in "ab":
        p.index.record(b, PROMPT)
    cands = [snap("a", 3), snap("b", 1), snap("c", 2)]
    # Every decision so far is this prompt: more than a third of the traffic of three.
    for _ in range(5):
        assert p.choose(facts(), cands).backend.id == "b"  # type: ignore[union-attr]


def test_a_new_prefix_goes_to_the_least_loaded_then_to_the_most_cache_room() -> None:
    p = policy()
    p.index.record("a", (101, 102, 103))
    p.index.record("c", (201,))
    new = facts((7, 8, 9))
    assert p.choose(new, [snap("a"), snap("b", 1), snap("c")]).backend.id == "c"  # type: ignore[union-attr]
    assert p.decisions["load"] == 1
    # Load first: the emptiest cache does not take a request it is busier for.
    other = facts((17, 18))
    assert p.choose(other, [snap("a"), snap("b", 1), snap("c", 1)]).backend.id == "a"  # type: ignore[union-attr]


def test_hash_placement_puts_a_new_prefix_where_every_replica_would() -> None:
    """Two replicas with different histories and different views of the load agree."""
    one, two = policy(seed=1, placement="hash"), policy(seed=2, placement="hash")
    one.index.record("a", (101, 102, 103))  # replica one has sent other prompts to a
    keyed = RouteFacts(model="m", prefix_hashes=(7, 8, 9), prefix_key=12345)
    first = one.choose(keyed, [snap("a", 1), snap("b", 0), snap("c", 2)])
    second = two.choose(keyed, [snap("a", 0), snap("b", 3), snap("c", 0)])
    assert first is not None
    assert second is not None
    assert first.backend.id == second.backend.id == max("abc", key=lambda b: rendezvous("12345", b))
    # Different prefixes spread over the backends.
    cands = [snap("a"), snap("b"), snap("c")]
    picks = {
        policy(placement="hash")
        .choose(  # type: ignore[union-attr]
            RouteFacts(model="m", prefix_hashes=(k,), prefix_key=k), cands
        )
        .backend.id
        for k in range(30)
    }
    assert picks == {"a", "b", "c"}


def test_hash_placement_respects_the_guard() -> None:
    p = policy(placement="hash", balance_abs=2.0, balance_rel=1.0)
    keyed = RouteFacts(model="m", prefix_hashes=(7, 8), prefix_key=99)
    winner = max("abc", key=lambda b: rendezvous("99", b))
    cands = [snap(b, 6 if b == winner else 1) for b in "abc"]
    choice = p.choose(keyed, cands)
    assert choice is not None
    assert choice.backend.id != winner


def test_ties_are_broken_at_random() -> None:
    p = policy(seed=3)
    for b in "abc":
        p.index.record(b, PROMPT)
    cands = [snap("a"), snap("b"), snap("c")]
    picks = Counter(p.choose(facts(), cands).backend.id for _ in range(300))  # type: ignore[union-attr]
    assert set(picks) == {"a", "b", "c"}
    assert min(picks.values()) > 60


def test_without_a_prompt_it_is_least_load() -> None:
    p = policy()
    cands = [snap("a", 2), snap("b", 0), snap("c", 1)]
    assert p.choose(facts(()), cands).backend.id == "b"  # type: ignore[union-attr]
    assert len(p.index) == 0
    assert p.choose(facts(), []) is None


def test_a_hot_prefix_spreads_once_its_backend_is_loaded() -> None:
    """The death spiral avoided: in-flight never exceeds the floor by more than the spread."""
    p = policy(balance_abs=3.0, balance_rel=1.0)
    in_flight = {"a": 0, "b": 0, "c": 0}
    for _ in range(30):  # every request has the same prefix, none finishes
        choice = p.choose(facts(), [snap(b, n) for b, n in in_flight.items()])
        assert choice is not None
        in_flight[choice.backend.id] += 1
        assert max(in_flight.values()) - min(in_flight.values()) <= 3
    assert min(in_flight.values()) >= 8
    assert p.decisions["balance"] > 0


def test_the_least_loaded_backend_is_never_overloaded() -> None:
    # With no tolerance at all, one more request puts anyone past the floor, but the least
    # loaded backend still takes it.
    p = policy(balance_abs=0.0, balance_rel=1.0)
    p.index.record("b", PROMPT)
    cands = [snap("a", 3), snap("b", 3), snap("c", 4)]
    assert p.choose(facts(), cands).backend.id == "b"  # type: ignore[union-attr]
    cands = [snap("a", 2), snap("b", 3)]
    assert p.choose(facts(), cands).backend.id == "a"  # type: ignore[union-attr]
    assert p.decisions["balance"] == 1


def test_no_choice_ever_takes_a_backend_past_the_spread() -> None:
    """Hot and cold prefixes, sticky owners, requests finishing at random: after every choice
    the chosen backend is within balance_abs or balance_rel of the least loaded one."""
    rng = random.Random(5)
    p = policy(seed=5, balance_abs=3.0, balance_rel=1.5)
    prompts = [tuple(range(g * 100, g * 100 + 8)) for g in range(12)]
    in_flight = dict.fromkeys("abcd", 0)
    for _ in range(3000):
        if rng.random() < 0.45:
            busy = [b for b, n in in_flight.items() if n]
            if busy:
                in_flight[rng.choice(busy)] -= 1
            continue
        prompt = prompts[0] if rng.random() < 0.5 else rng.choice(prompts[1:])
        floor = min(in_flight.values())
        choice = p.choose(facts(prompt), [snap(b, n) for b, n in in_flight.items()])
        assert choice is not None
        in_flight[choice.backend.id] += 1
        after = in_flight[choice.backend.id]
        assert after - floor <= 3 or after <= floor * 1.5
    assert p.decisions["prefix"] > 0
    assert p.decisions["balance"] > 0


def test_a_session_sticks_to_its_rendezvous_backend() -> None:
    p = policy(session_header="x-session-id")
    cands = [snap("a"), snap("b"), snap("c")]
    expected = max("abc", key=lambda b: rendezvous("s-42", b))
    p.index.record("a" if expected != "a" else "b", PROMPT)  # a prefix elsewhere does not win
    for _ in range(5):
        assert p.choose(facts(session="s-42"), cands).backend.id == expected  # type: ignore[union-attr]
    assert p.decisions["session"] == 5


def test_sessions_spread_over_backends() -> None:
    p = policy(session_header="x-session-id")
    cands = [snap("a"), snap("b"), snap("c")]
    picks = Counter(p.choose(facts((), f"s{i}"), cands).backend.id for i in range(300))  # type: ignore[union-attr]
    assert set(picks) == {"a", "b", "c"}


def test_a_session_falls_back_when_its_backend_is_gone_or_overloaded() -> None:
    p = policy(session_header="x-session-id", balance_abs=2.0, balance_rel=1.0)
    order = sorted("abc", key=lambda b: rendezvous("s-1", b), reverse=True)
    first, second = order[0], order[1]
    # Gone: the next rendezvous choice among the candidates, the same one every time.
    rest = [snap(b) for b in "abc" if b != first]
    assert p.choose(facts(session="s-1"), rest).backend.id == second  # type: ignore[union-attr]
    # Overloaded: routed like any other request (here by least load).
    cands = [snap(b, 5 if b == first else (1 if b == second else 0)) for b in "abc"]
    assert p.choose(facts((), "s-1"), cands).backend.id == order[2]  # type: ignore[union-attr]
    assert p.decisions["session_overflow"] == 1


def test_sessions_are_ignored_unless_a_header_is_configured() -> None:
    p = policy()
    p.index.record("c", PROMPT)
    cands = [snap("a"), snap("b"), snap("c")]
    assert p.choose(facts(session="s-1"), cands).backend.id == "c"  # type: ignore[union-attr]
    assert p.decisions["session"] == 0


def test_make_policy_builds_it_and_keeps_its_memory_across_a_retune() -> None:
    old = make_policy("prefix_affinity", affinity=AffinityConfig(balance_abs=2.0))
    assert isinstance(old, PrefixAffinity)
    old.index.record("a", PROMPT)
    new = make_policy(
        "prefix_affinity", Weights(active=1), affinity=AffinityConfig(balance_abs=9.0), previous=old
    )
    assert isinstance(new, PrefixAffinity)
    assert new.index is old.index
    assert new.heat is old.heat
    assert new.config.balance_abs == 9.0
    assert new.weights == Weights(active=1)
    # Other block sizes hash differently: the old memory is useless, start afresh.
    other = make_policy("prefix_affinity", affinity=AffinityConfig(block_chars=32), previous=new)
    assert isinstance(other, PrefixAffinity)
    assert len(other.index) == 0


def test_the_index_is_sized_by_the_config() -> None:
    index = PrefixIndex(1000)
    index.record("a", list(range(1000)))
    p = PrefixAffinity(config=AffinityConfig(index_capacity=200, max_blocks=100), index=index)
    assert len(p.index) == 200


@pytest.mark.parametrize(
    "bad",
    [
        {"balance_rel": 0.5},
        {"balance_abs": -1.0},
        {"index_capacity": 10, "max_blocks": 20},
        {"block_chars": 0},
        {"balance_on": "queue"},
        {"placement": "random"},
    ],
)
def test_config_rejects_nonsense(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case has its own message
        AffinityConfig(**bad)  # type: ignore[arg-type]
