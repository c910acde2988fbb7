"""precise_prefix's decisions on hand-built snapshots and an index fed with KV events."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from policies import (
    AffinityConfig,
    BackendSnapshot,
    Decision,
    KvIndex,
    Outcome,
    PrecisePrefix,
    PrefixAffinity,
    RouteFacts,
    Weights,
    make_policy,
    precise_prefix,
)
from policies.kv_index import Removed, Stored, cacheable_blocks, chain_keys
from policies.prefix_affinity import rendezvous

BS = 4
PROMPT = tuple(range(1000, 1033))  # 33 tokens: eight full blocks of four, all cacheable
HASHES = (1, 2, 3, 4, 5, 6)  # the prompt's character-block hashes, for the fallback
OK = Outcome(ok=True, status=200)


def snap(id_: str, in_flight: int = 0, **kw: object) -> BackendSnapshot:
    return BackendSnapshot(id=id_, in_flight=in_flight, **kw)  # type: ignore[arg-type]


def facts(
    tokens: tuple[int, ...] | None = PROMPT,
    session: str | None = None,
    hashes: tuple[int, ...] = HASHES,
) -> RouteFacts:
    return RouteFacts(model="m", session_key=session, prefix_hashes=hashes, prompt_tokens=tokens)


def policy(index: KvIndex, seed: int = 0, **config: object) -> PrecisePrefix:
    cfg = AffinityConfig(**{"balance_abs": 4.0, "balance_rel": 1.5, **config})  # type: ignore[arg-type]
    return PrecisePrefix(index, rng=random.Random(seed), config=cfg)


def live(*backends: str, index: KvIndex | None = None) -> KvIndex:
    index = index or KvIndex()
    for b in backends:
        index.set_live(b, True)
    return index


def hold(
    index: KvIndex, backend: str, blocks: int, tokens: Sequence[int] = PROMPT, bs: int = BS
) -> None:
    """``backend``'s engine reports caching the first ``blocks`` blocks of ``tokens``."""
    hashes = [f"{backend}/{tokens[0]}/{i}".encode() for i in range(blocks)]
    index.apply(backend, [Stored(hashes, None, list(tokens[: blocks * bs]), bs)])


def decide(p: PrecisePrefix, f: RouteFacts, cands: list[BackendSnapshot]) -> Decision:
    decision = p.choose(f, cands)
    assert decision is not None
    return decision


def choose(p: PrecisePrefix, f: RouteFacts, cands: list[BackendSnapshot]) -> str:
    return decide(p, f, cands).backend.id


# -- the exact decision ----------------------------------------------------------------------


@pytest.mark.parametrize("bs", [4, 16])
def test_the_backend_holding_the_longest_prefix_wins(bs: int) -> None:
    tokens = tuple(range(500, 500 + 4 * bs + 1))  # four cacheable blocks
    index = live("a", "b", "c")
    hold(index, "a", 1, tokens, bs)
    hold(index, "b", 3, tokens, bs)
    hold(index, "c", 2, (7,) * (4 * bs), bs)  # another prompt
    p = policy(index)
    cands = [snap("a", 1), snap("b", 2), snap("c", 0)]
    assert choose(p, facts(tokens), cands) == "b"
    assert p.decisions == {"prefix": 1}


def test_a_block_with_the_prompts_last_token_does_not_count() -> None:
    """vLLM always computes the last token: a 32-token prompt serves at most 28 from cache."""
    tokens = PROMPT[:32]
    index = live("a", "b")
    hold(index, "a", 8, tokens)  # every block, the last one included
    hold(index, "b", 7, tokens)
    p = policy(index)
    # Both serve 28 tokens: the tie goes to the least loaded.
    assert choose(p, facts(tokens), [snap("a", 1), snap("b", 0)]) == "b"
    assert choose(p, facts(tokens), [snap("a", 0), snap("b", 1)]) == "a"


def test_among_equal_matches_the_least_loaded_wins() -> None:
    index = live("a", "b", "c")
    for b in "abc":
        hold(index, b, 5)
    p = policy(index)
    assert choose(p, facts(), [snap("a", 3), snap("b", 1), snap("c", 2)]) == "b"
    assert p.decisions["prefix"] == 1


def test_ties_at_equal_load_are_broken_at_random() -> None:
    index = live("a", "b", "c")
    for b in "abc":
        hold(index, b, 5)
    p = policy(index, seed=3)
    picks = set()
    for _ in range(60):
        f = facts()
        decision = decide(p, f, [snap("a"), snap("b"), snap("c")])
        picks.add(decision.backend.id)
        p.on_result(f, decision, OK)  # settled: its tentative credit does not tip the next one
    assert picks == {"a", "b", "c"}


def test_a_removed_block_ends_the_prefix_there() -> None:
    index = live("a", "b")
    hold(index, "a", 6)
    hold(index, "b", 4)
    index.apply("a", [Removed([b"a/1000/2"])])  # a's third block evicted: a holds two
    p = policy(index)
    assert choose(p, facts(), [snap("a"), snap("b")]) == "b"


def test_the_engines_own_view_wins_over_what_this_gateway_sent() -> None:
    """The fallback believes c holds the prompt; the engines say b does."""
    index = live("a", "b", "c")
    hold(index, "b", 3)
    p = policy(index)
    p.approximate.index.record("c", HASHES)
    assert choose(p, facts(), [snap("a"), snap("b"), snap("c")]) == "b"


# -- the balance guard and sessions ----------------------------------------------------------


def test_load_wins_past_both_thresholds_and_the_reason_is_balance() -> None:
    index = live("a", "b", "c")
    hold(index, "b", 8)
    p = policy(index, balance_abs=4.0, balance_rel=1.5)
    # One more puts b 5 above the floor of 2 (> 4) and 7 > 2 x 1.5: overloaded.
    assert choose(p, facts(), [snap("a", 2), snap("b", 6), snap("c", 3)]) == "a"
    assert p.decisions == {"balance": 1}


def test_the_guard_passes_a_longer_match_over_for_a_shorter_one() -> None:
    index = live("a", "b", "c")
    hold(index, "a", 6)
    hold(index, "b", 2)
    p = policy(index, balance_abs=4.0, balance_rel=1.5)
    assert choose(p, facts(), [snap("a", 9), snap("b", 3), snap("c", 2)]) == "b"
    assert p.decisions == {"balance": 1}


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
    index = live("a", "b", "c")
    hold(index, "b", 8)
    p = policy(index, balance_abs=4.0, balance_rel=1.5)
    cands = [snap(i, n) for i, n in zip("abc", loads, strict=True)]
    assert choose(p, facts(), cands) == "b", why
    assert p.decisions == {"prefix": 1}


def test_the_guard_can_run_on_the_load_score() -> None:
    index = live("a", "b")
    hold(index, "b", 8)
    p = policy(index, balance_on="score", balance_abs=10.0, balance_rel=1.0)
    # In-flight counts are equal, but b's scraped queue puts its score 12 above a's.
    assert choose(p, facts(), [snap("a", 1, queue_depth=0), snap("b", 1, queue_depth=4)]) == "a"
    assert p.decisions == {"balance": 1}


def test_a_session_sticks_to_its_rendezvous_backend() -> None:
    index = live("a", "b", "c")
    expected = max("abc", key=lambda b: rendezvous("s-42", b))
    hold(index, "a" if expected != "a" else "b", 8)  # a prefix elsewhere does not win
    p = policy(index, session_header="x-session-id")
    for _ in range(5):
        assert choose(p, facts(session="s-42"), [snap("a"), snap("b"), snap("c")]) == expected
    assert p.decisions == {"session": 5}


def test_an_overloaded_session_backend_falls_through_to_the_prefix() -> None:
    index = live("a", "b", "c")
    order = sorted("abc", key=lambda b: rendezvous("s-1", b), reverse=True)
    first, second, third = order
    hold(index, third, 4)
    p = policy(index, session_header="x-session-id", balance_abs=2.0, balance_rel=1.0)
    cands = [snap(b, 5 if b == first else 1) for b in "abc"]
    assert choose(p, facts(session="s-1"), cands) == third
    assert p.decisions == {"session_overflow": 1}
    # Its backend gone: the next rendezvous winner, whatever the caches hold.
    rest = [snap(b) for b in "abc" if b != first]
    assert choose(p, facts(session="s-1"), rest) == second
    assert p.decisions["session"] == 1


def test_sessions_are_ignored_unless_a_header_is_configured() -> None:
    index = live("a", "b", "c")
    hold(index, "c", 3)
    p = policy(index)
    assert choose(p, facts(session="s-1"), [snap("a"), snap("b"), snap("c")]) == "c"
    assert p.decisions == {"prefix": 1}


# -- placement of a prompt nobody holds ------------------------------------------------------


def test_a_prompt_nobody_holds_goes_to_the_least_loaded() -> None:
    index = live("a", "b", "c")
    p = policy(index)
    assert choose(p, facts(), [snap("a", 1), snap("b", 0), snap("c", 2)]) == "b"
    assert p.decisions == {"load": 1}


def test_among_the_least_loaded_the_cache_holding_fewest_blocks_wins() -> None:
    index = live("a", "b", "c")
    hold(index, "a", 5, (1,) * 40)
    hold(index, "b", 2, (2,) * 40)
    hold(index, "c", 3, (3,) * 40)
    p = policy(index)
    assert choose(p, facts(), [snap("a"), snap("b"), snap("c")]) == "b"
    # Load first: the emptiest cache does not take a request it is busier for.
    other = facts((9,) * 20)
    assert choose(p, other, [snap("a"), snap("b", 1), snap("c", 1)]) == "a"
    assert p.decisions == {"load": 2}


def test_a_prompt_only_an_overloaded_backend_holds_is_placed_by_load_for_balance() -> None:
    index = live("a", "b", "c")
    hold(index, "a", 8)
    p = policy(index, balance_abs=2.0, balance_rel=1.0)
    assert choose(p, facts(), [snap("a", 5), snap("b", 1), snap("c", 0)]) == "c"
    assert p.decisions == {"balance": 1}


def test_a_prompt_too_short_for_a_block_goes_by_load() -> None:
    index = live("a", "b")
    hold(index, "a", 8)
    p = policy(index)
    assert choose(p, facts(PROMPT[:4]), [snap("a", 1), snap("b")]) == "b"  # 0 cacheable
    assert choose(p, facts(()), [snap("a", 1), snap("b")]) == "b"
    assert p.decisions == {"load": 2}


def test_no_candidates_no_choice() -> None:
    p = policy(live("a"))
    assert p.choose(facts(), []) is None
    assert p.decisions == {}


# -- the fallback ----------------------------------------------------------------------------


def test_without_tokens_the_fallback_routes_by_its_approximate_index() -> None:
    index = live("a", "b", "c")
    hold(index, "a", 8)  # the engines' view, unused without tokens
    p = policy(index)
    p.approximate.index.record("c", HASHES)
    assert choose(p, facts(None), [snap("a"), snap("b"), snap("c")]) == "c"
    assert p.decisions == {"fallback_no_tokens": 1}
    assert p.approximate.decisions == {"prefix": 1}


def test_a_candidate_that_is_not_live_sends_the_decision_to_the_fallback() -> None:
    index = live("a", "b")  # c's events are not followed
    hold(index, "a", 8)
    p = policy(index)
    p.approximate.index.record("c", HASHES)
    assert choose(p, facts(), [snap("a"), snap("b"), snap("c")]) == "c"
    assert p.decisions == {"fallback_not_live": 1}
    # Once c is live, the engines decide.
    index.set_live("c", True)
    assert choose(p, facts(), [snap("a"), snap("b"), snap("c")]) == "a"
    # And a live backend that goes down sends it back.
    index.set_live("a", False)
    assert choose(p, facts(), [snap("a"), snap("b"), snap("c")]) == "c"
    assert p.decisions == {"fallback_not_live": 2, "prefix": 1}


def test_only_the_candidates_need_to_be_live() -> None:
    index = live("a", "b")
    hold(index, "b", 2)
    p = policy(index)
    assert choose(p, facts(), [snap("a"), snap("b")]) == "b"
    assert p.decisions == {"prefix": 1}


def test_exact_decisions_keep_the_fallbacks_index_warm() -> None:
    index = live("a", "b", "c")
    hold(index, "b", 3)
    p = policy(index)
    assert choose(p, facts(), [snap("a"), snap("b"), snap("c")]) == "b"
    assert p.approximate.index.match(HASHES, ["a", "b", "c"]) == {"a": 0, "b": 6, "c": 0}
    # So when b's events stop, the fallback still sends the prompt there.
    index.set_live("b", False)
    assert choose(p, facts(), [snap("a"), snap("b"), snap("c")]) == "b"
    assert p.decisions == {"prefix": 1, "fallback_not_live": 1}


def test_the_fallbacks_own_choice_is_settled_by_the_fallback() -> None:
    index = live("a")
    p = policy(index)
    f = facts(None)
    decision = decide(p, f, [snap("a"), snap("b")])
    first = decision.backend.id
    assert p.approximate.index.match(HASHES, [first]) == {first: len(HASHES)}
    p.on_result(f, decision, Outcome(ok=False, error="unreachable"))
    assert p.approximate.index.match(HASHES, [first]) == {first: 0}  # withdrawn


def test_a_failed_exact_choice_is_withdrawn_from_the_fallbacks_index() -> None:
    index = live("a", "b")
    hold(index, "b", 3)
    p = policy(index)
    f = facts()
    decision = decide(p, f, [snap("a"), snap("b")])
    assert decision.backend.id == "b"
    p.on_result(f, decision, Outcome(ok=False, error="unreachable"))
    assert p.approximate.index.match(HASHES, ["b"]) == {"b": 0}


# -- tentative credit ------------------------------------------------------------------------


def test_a_burst_of_a_new_prompt_follows_the_first_choice_until_its_outcome() -> None:
    index = live("a", "b", "c")
    for b in "abc":
        hold(index, b, 2, (ord(b),) * 8)  # each engine has reported something: sizes known
    p = policy(index)
    in_flight = dict.fromkeys("abc", 0)

    def route(f: RouteFacts) -> Decision:
        decision = decide(p, f, [snap(b, n) for b, n in in_flight.items()])
        in_flight[decision.backend.id] += 1
        return decision

    one = route(facts())
    first = one.backend.id
    assert p.decisions == {"load": 1}
    # No BlockStored yet: the chosen backend is credited with the prompt's blocks.
    assert route(facts()).backend.id == first
    assert p.decisions == {"load": 1, "prefix": 1}
    p.on_result(facts(), one, OK)
    assert route(facts()).backend.id == first  # the other attempts' credit is still there
    p.on_result(facts(), Decision(snap(first)), OK)  # a decision it never made: ignored
    p.on_result(facts(), one, OK)  # settled already: nothing more taken back
    assert route(facts()).backend.id == first
    assert p.decisions == {"load": 1, "prefix": 3}


def test_once_every_attempt_is_settled_the_credit_is_gone() -> None:
    index = live("a", "b", "c")
    for b in "abc":
        hold(index, b, 2, (ord(b),) * 8)
    p = policy(index)
    burst = [decide(p, facts(), [snap("a"), snap("b"), snap("c")])]
    first = burst[0].backend.id
    cands = [snap(b, 1 if b == first else 0) for b in "abc"]
    for _ in range(2):
        burst.append(decide(p, facts(), cands))
        assert burst[-1].backend.id == first
    for decision in burst:
        p.on_result(facts(), decision, OK)
    # No event came: nobody holds the prompt, and first is busier than the others.
    assert choose(p, facts(), cands) != first
    assert p.decisions == {"load": 2, "prefix": 2}


def test_a_failed_attempt_takes_its_credit_back_too() -> None:
    index = live("a", "b")
    hold(index, "a", 1, (5,) * 4)
    hold(index, "b", 1, (6,) * 4)
    p = policy(index)
    f = facts()
    decision = decide(p, f, [snap("a"), snap("b")])
    first = decision.backend.id
    p.on_result(f, decision, Outcome(ok=False, error="refused", status=503))
    other = "b" if first == "a" else "a"
    assert choose(p, facts(), [snap(first, 1), snap(other)]) == other


def test_credit_is_per_backend_and_per_prompt() -> None:
    index = live("a", "b")
    hold(index, "a", 1, (5,) * 4)
    hold(index, "b", 1, (6,) * 4)
    p = policy(index)
    first = choose(p, facts(), [snap("a"), snap("b")])
    other = "b" if first == "a" else "a"
    # Another prompt is not credited to first: it goes by load.
    assert choose(p, facts(tuple(range(50, 83))), [snap(first, 1), snap(other)]) == other
    # A prompt sharing the first three blocks: first holds them (tentatively), other nothing.
    shared = (*PROMPT[:12], *range(60, 81))
    assert choose(p, facts(shared), [snap(first, 1), snap(other, 1)]) == first


def test_events_and_credit_combine_as_the_longer_of_the_two() -> None:
    index = live("a", "b")
    hold(index, "a", 2)
    hold(index, "b", 4)
    p = policy(index)
    f = facts()
    decision = decide(p, f, [snap("a"), snap("b")])
    assert decision.backend.id == "b"
    # b's engine evicted the blocks before reporting the new ones: the credit still counts.
    index.apply("b", [Removed([f"b/{PROMPT[0]}/{i}".encode() for i in range(4)])])
    assert choose(p, facts(), [snap("a", 1), snap("b", 1)]) == "b"
    p.on_result(f, decision, OK)


def test_credit_whose_outcome_never_comes_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decisions dropped unsettled leave at most ``_TENTATIVE_MAX`` credits: the oldest
    is taken back, and its late outcome takes back nothing more."""
    monkeypatch.setattr(precise_prefix, "_TENTATIVE_MAX", 2)
    index = live("a", "b")
    p = policy(index)
    prompts = [tuple(range(100 * i, 100 * i + 33)) for i in range(1, 4)]
    dropped = [decide(p, facts(tokens), [snap("a")]) for tokens in prompts]

    def credited() -> list[float]:
        return [p.held_tokens(facts(tokens), [snap("a")])["a"] for tokens in prompts]

    assert credited() == [0, 32, 32]  # the first prompt's credit is gone, the last two's stay
    p.on_result(facts(prompts[0]), dropped[0], OK)
    assert credited() == [0, 32, 32]
    p.on_result(facts(prompts[1]), dropped[1], OK)
    assert credited() == [0, 0, 32]


def test_a_burst_of_a_new_prompt_follows_the_first_choice_before_any_event() -> None:
    index = live("a", "b", "c")
    p = policy(index)
    in_flight = dict.fromkeys("abc", 0)
    first = choose(p, facts(), [snap(b, n) for b, n in in_flight.items()])
    in_flight[first] += 1
    assert choose(p, facts(), [snap(b, n) for b, n in in_flight.items()]) == first


# -- predicted, block sizes ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "held", "expected"),
    [
        (33, 8, 32),  # eight full blocks, the last token after them
        (33, 3, 12),
        (32, 8, 28),  # the eighth block holds the last token: not served
        (17, 8, 16),  # the index holds more than the prompt has
        (3, 8, 0),
        (0, 8, 0),
    ],
)
def test_predicted_is_the_held_blocks_an_engine_can_serve(
    length: int, held: int, expected: int
) -> None:
    index = live("a")
    hold(index, "a", held)
    p = policy(index)
    tokens = PROMPT[:length]
    assert p.predicted(tokens, "a") == expected
    assert expected == min(held, cacheable_blocks(length, BS)) * BS
    assert p.predicted(list(tokens), "a") == expected


def test_predicted_of_a_backend_without_events_is_zero() -> None:
    index = live("a")
    p = policy(index)
    assert p.predicted(PROMPT, "a") == 0
    assert p.predicted(PROMPT, "stranger") == 0
    hold(index, "a", 2, (1,) * 8)
    assert p.predicted(PROMPT, "a") == 0  # it holds another prompt


def test_predicted_uses_each_backends_block_size() -> None:
    index = live("four", "sixteen")
    hold(index, "four", 5, PROMPT, 4)
    hold(index, "sixteen", 2, PROMPT, 16)
    p = policy(index)
    assert p.predicted(PROMPT, "four") == 20
    assert p.predicted(PROMPT, "sixteen") == 32


def test_backends_with_different_block_sizes_are_compared_in_tokens() -> None:
    tokens = tuple(range(2000, 2040))  # 40 tokens: 9 cacheable blocks of 4, 2 of 16
    index = live("four", "sixteen")
    hold(index, "four", 6, tokens, 4)  # 24 tokens
    hold(index, "sixteen", 2, tokens, 16)  # 32 tokens
    p = policy(index)
    cands = [snap("four"), snap("sixteen")]
    assert choose(p, facts(tokens), cands) == "sixteen"
    hold(index, "four", 9, tokens, 4)  # 36 tokens
    assert choose(p, facts(tokens), [snap("four", 1), snap("sixteen")]) == "four"
    assert p.decisions == {"prefix": 2}


def test_keys_of_one_block_size_never_match_another() -> None:
    """A 16-token engine holding the prompt is nothing to a 4-token lookup, and back."""
    index = live("a")
    hold(index, "a", 2, PROMPT, 16)
    assert index.match(chain_keys(PROMPT, 4), ["a"]) == {"a": 0}
    assert index.match(chain_keys(PROMPT, 16), ["a"]) == {"a": 2}


def test_max_blocks_bounds_the_keyed_prefix() -> None:
    index = live("a", "b")
    hold(index, "a", 8)
    hold(index, "b", 3)
    p = PrecisePrefix(index, rng=random.Random(0), max_blocks=2)
    assert p.predicted(PROMPT, "a") == 8
    assert p.predicted(PROMPT, "b") == 8
    with pytest.raises(ValueError, match="max_blocks"):
        PrecisePrefix(index, max_blocks=0)


def test_it_asks_for_the_prompts_tokens_and_its_block_hashes() -> None:
    p = policy(KvIndex(), session_header="x-session-id")
    assert p.needs.tokens
    assert p.needs.prefix == p.config.hasher
    assert p.needs.session_header == "x-session-id"
    assert p.name == "precise_prefix"


# -- make_policy -----------------------------------------------------------------------------


def test_make_policy_needs_the_kv_index() -> None:
    with pytest.raises(ValueError, match="KV-event index"):
        make_policy("precise_prefix")


def test_make_policy_keeps_the_approximate_index_of_a_prefix_affinity() -> None:
    old = make_policy("prefix_affinity")
    assert isinstance(old, PrefixAffinity)
    old.index.record("a", HASHES)
    index = KvIndex()
    new = make_policy(
        "precise_prefix", Weights(active=1), random.Random(0), previous=old, kv_index=index
    )
    assert isinstance(new, PrecisePrefix)
    assert new.index is index
    assert new.approximate.index is old.index
    assert new.approximate.heat is old.heat
    assert new.weights == Weights(active=1)


def test_make_policy_keeps_the_fallback_and_the_counts_of_a_precise_prefix() -> None:
    index = live("a", "b")
    hold(index, "b", 2)
    old = make_policy("precise_prefix", rng=random.Random(0), kv_index=index)
    assert isinstance(old, PrecisePrefix)
    assert choose(old, facts(), [snap("a"), snap("b")]) == "b"
    new = make_policy(
        "precise_prefix", affinity=AffinityConfig(balance_abs=9.0), previous=old, kv_index=index
    )
    assert isinstance(new, PrecisePrefix)
    assert new.approximate.index is old.approximate.index
    assert new.decisions == {"prefix": 1}
    assert new.config.balance_abs == 9.0
    assert new.approximate.config.balance_abs == 9.0
    # Back to prefix_affinity: the approximate index is still kept.
    back = make_policy("prefix_affinity", previous=new)
    assert isinstance(back, PrefixAffinity)
    assert back.index is old.approximate.index
    # Another block size hashes differently: that memory is useless, start afresh.
    other = make_policy(
        "precise_prefix", affinity=AffinityConfig(block_chars=32), previous=new, kv_index=index
    )
    assert isinstance(other, PrecisePrefix)
    assert len(other.approximate.index) == 0
