"""The capacity manager's decisions, as plain function calls with an injected time."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from backends.sleep import Rest
from gateway.capacity.plan import Demand, Engine, EngineStep, Rule, Turn, decide, need

M = "m"


def engines(*rests: Rest, load: Sequence[float] = (), since: float = 0.0) -> list[Engine]:
    loads = list(load) + [0.0] * (len(rests) - len(load))
    return [Engine(f"e{i}", r, frozenset({M}), loads[i], since=since) for i, r in enumerate(rests)]


def steps(turn: Turn, action: str) -> list[str]:
    return [s.engine for s in turn.steps if s.action == action]


def test_need_looks_one_wake_time_ahead_with_headroom() -> None:
    rule = Rule(per_engine=10, headroom=0.2, wake_time=5)
    flat = need(M, rule, Demand(load=20), awake=3, engines=6)
    rising = need(M, rule, Demand(load=20, trend=2.0), awake=3, engines=6)
    assert flat.engines == 3  # 20 x 1.2 / 10 = 2.4
    assert rising.engines == 4  # (20 + 2 x 5) x 1.2 / 10 = 3.6
    # a falling trend is not trusted to shrink: the idle spell does that
    assert need(M, rule, Demand(load=20, trend=-3.0), awake=3, engines=6).engines == 3


def test_need_is_bounded_by_the_rule_but_desired_is_not() -> None:
    rule = Rule(per_engine=1, headroom=0, min_awake=2, max_awake=4)
    assert need(M, rule, Demand(load=0), awake=2, engines=8).engines == 2
    big = need(M, rule, Demand(load=10), awake=4, engines=8)
    assert (big.engines, big.desired) == (4, 10)
    assert need(M, rule, Demand(load=10), awake=2, engines=3).engines == 3  # engines there are


def test_slow_first_tokens_or_a_full_kv_cache_ask_for_one_more() -> None:
    rule = Rule(per_engine=100, ttft_slo=0.5, kv_high=0.8)
    assert need(M, rule, Demand(load=1, ttft=0.9), awake=2, engines=4).engines == 3
    assert need(M, rule, Demand(load=1, ttft=0.1), awake=2, engines=4).engines == 1
    assert need(M, rule, Demand(load=1, kv=0.95), awake=2, engines=4).engines == 3


def test_a_held_request_needs_an_engine_even_when_zero_may_sleep() -> None:
    rule = Rule(min_awake=0)
    assert need(M, rule, Demand(load=0), awake=0, engines=2).engines == 0
    assert need(M, rule, Demand(load=0, held=1), awake=0, engines=2).engines == 1


def test_more_demand_wakes_the_warm_engines_first_then_the_asleep_ones() -> None:
    es = engines(Rest.AWAKE, Rest.ASLEEP, Rest.GOING_TO_SLEEP, Rest.ASLEEP)
    turn = decide({M: Rule(per_engine=1, headroom=0)}, {M: Demand(load=3)}, es, 100.0, {})
    assert steps(turn, "wake") == ["e2", "e1"]
    assert steps(turn, "sleep") == []


def test_an_engine_sleeps_only_after_demand_stayed_low_for_the_idle_spell() -> None:
    rule = Rule(per_engine=10, headroom=0, idle_before_sleep=60)
    es = engines(Rest.AWAKE, Rest.AWAKE, Rest.AWAKE, load=(1, 0, 0))
    low: dict[str, float] = {}
    first = decide({M: rule}, {M: Demand(load=1)}, es, 1000.0, low)
    assert steps(first, "sleep") == []
    assert first.low_since == {M: 1000.0}
    early = decide({M: rule}, {M: Demand(load=1)}, es, 1059.0, first.low_since)
    assert steps(early, "sleep") == []
    late = decide({M: rule}, {M: Demand(load=1)}, es, 1060.0, early.low_since)
    assert steps(late, "sleep") == ["e2"]  # idle, and the last by id: e0 and e1 stay
    assert late.low_since == {M: 1060.0}  # the next one after another spell


def test_demand_back_up_restarts_the_idle_spell() -> None:
    rule = Rule(per_engine=10, headroom=0, idle_before_sleep=60)
    es = engines(Rest.AWAKE, Rest.AWAKE)
    t1 = decide({M: rule}, {M: Demand(load=1)}, es, 0.0, {})
    t2 = decide({M: rule}, {M: Demand(load=15)}, es, 30.0, t1.low_since)
    assert t2.low_since == {}
    t3 = decide({M: rule}, {M: Demand(load=1)}, es, 70.0, t2.low_since)
    assert steps(t3, "sleep") == []
    assert t3.low_since == {M: 70.0}


def test_the_last_awake_engine_sleeps_only_if_the_rule_allows_zero() -> None:
    es = engines(Rest.AWAKE, Rest.ASLEEP)
    keep = Rule(idle_before_sleep=0)
    assert steps(decide({M: keep}, {M: Demand(0)}, es, 10.0, {M: 0.0}), "sleep") == []
    zero = Rule(idle_before_sleep=0, min_awake=0)
    assert steps(decide({M: zero}, {M: Demand(0)}, es, 10.0, {M: 0.0}), "sleep") == ["e0"]


def test_one_engine_goes_to_sleep_at_a_time() -> None:
    es = engines(Rest.AWAKE, Rest.AWAKE, Rest.GOING_TO_SLEEP, load=(0, 0, 3))
    turn = decide({M: Rule(idle_before_sleep=0)}, {M: Demand(0)}, es, 10.0, {M: 0.0})
    assert steps(turn, "sleep") == []


def test_an_engine_going_to_sleep_is_put_to_sleep_once_idle_and_settled() -> None:
    rule = Rule(drain_timeout=100, sleep_level=2, sleep_mode="wait")
    busy = engines(Rest.AWAKE, Rest.GOING_TO_SLEEP, load=(0, 2), since=0.0)
    assert steps(decide({M: rule}, {M: Demand(2)}, busy, 50.0, {}, settle=2), "put_to_sleep") == []
    idle = engines(Rest.AWAKE, Rest.GOING_TO_SLEEP, since=0.0)
    unsettled = decide({M: rule}, {M: Demand(0)}, idle, 1.0, {}, settle=2)
    assert steps(unsettled, "put_to_sleep") == []  # the other replicas may still send it work
    done = decide({M: rule}, {M: Demand(0)}, idle, 3.0, {}, settle=2)
    assert [s for s in done.steps if s.action == "put_to_sleep"] == [
        EngineStep("put_to_sleep", "e1", "idle", level=2, mode="wait")
    ]
    late = decide({M: rule}, {M: Demand(2)}, busy, 100.0, {}, settle=2)
    assert steps(late, "put_to_sleep") == ["e1"]  # out of time: the mode says what happens


def test_an_engine_wanted_awake_and_still_asleep_is_woken() -> None:
    es = engines(Rest.AWAKE, Rest.WAKING)
    assert steps(decide({M: Rule()}, {M: Demand(0)}, es, 0.0, {}), "wake_up") == ["e1"]


def test_an_engine_another_model_needs_is_not_put_to_sleep() -> None:
    shared = Engine("e0", Rest.AWAKE, frozenset({M, "other"}))
    mine = Engine("e1", Rest.AWAKE, frozenset({M}), load=5)
    others = Engine("e2", Rest.AWAKE, frozenset({"other"}))
    rules = {M: Rule(idle_before_sleep=0, per_engine=10), "other": Rule(per_engine=1, headroom=0)}
    demands = {M: Demand(1), "other": Demand(2)}
    turn = decide(rules, demands, [shared, mine, others], 10.0, {M: 0.0})
    assert steps(turn, "sleep") == ["e1"]  # the busier one, since e0 serves "other" too


def test_engines_down_are_left_alone() -> None:
    es = [Engine("e0", Rest.ASLEEP, frozenset({M}), up=False)]
    turn = decide({M: Rule(per_engine=1)}, {M: Demand(5)}, es, 0.0, {})
    assert turn.steps == []
    assert M not in turn.needs


@pytest.mark.parametrize(
    "bad",
    [{"min_awake": -1}, {"min_awake": 3, "max_awake": 2}, {"per_engine": 0}, {"sleep_level": 3}],
)
def test_a_rule_out_of_bounds_is_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="capacity"):
        Rule(**bad)  # type: ignore[arg-type]


def test_an_engine_that_cannot_sleep_is_never_picked_and_is_taken_back_if_wanted_asleep() -> None:
    rule = Rule(idle_before_sleep=0, min_awake=0)
    mute = Engine("e0", Rest.AWAKE, frozenset({M}), can_sleep=False)
    turn = decide({M: rule}, {M: Demand(0)}, [mute], 10.0, {M: 0.0})
    assert steps(turn, "sleep") == []
    slept_by_hand = Engine("e0", Rest.GOING_TO_SLEEP, frozenset({M}), can_sleep=False)
    turn = decide({M: rule}, {M: Demand(0)}, [slept_by_hand], 10.0, {})
    assert steps(turn, "wake") == ["e0"]
    assert steps(turn, "put_to_sleep") == []
