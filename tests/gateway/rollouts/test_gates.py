"""The gate arithmetic of a progressive rollout (pure): windows from cumulative counts, each
gate's limit from the stable pool's figures, and the decision at each step."""

from __future__ import annotations

import math

import pytest

from gateway.fleet.figures import PoolCounts
from gateway.rollouts.gates import Gates, agreement, certain_error_breach, judge
from gateway.rollouts.plan import Plan, PlanError, decide

INF = math.inf


def hist(
    *samples: float, bounds: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4, 0.8)
) -> tuple[tuple[float, int], ...]:
    """Cumulative buckets of ``samples``, as Prometheus keeps them."""
    return tuple((b, sum(1 for s in samples if s <= b)) for b in (*bounds, INF))


def pool(requests: int, errors: int = 0, ttft: float = 0.09, itl: float = 0.02) -> PoolCounts:
    """``requests`` answered, every one timed at ``ttft`` and ``itl``."""
    return PoolCounts(requests, errors, hist(*[ttft] * requests), hist(*[itl] * requests))


def test_every_gate_passes_for_a_canary_like_stable() -> None:
    readings = judge(pool(200, 2), pool(2000, 20), Gates(ttft_p99_slo=1.0, itl_p50_slo=0.1))
    assert [r.gate for r in readings] == [
        "errors",
        "ttft_p99",
        "itl_p50",
        "ttft_p99_slo",
        "itl_p50_slo",
    ]
    assert all(r.passed for r in readings)


def test_the_error_gate_is_stables_rate_plus_the_margin() -> None:
    gates = Gates(error_margin=0.02)
    stable = pool(1000, 10)  # 1 %
    ok, bad = judge(pool(100, 3), stable, gates)[0], judge(pool(100, 4), stable, gates)[0]
    assert ok.limit == pytest.approx(0.03)
    assert ok.passed
    assert bad.canary == pytest.approx(0.04)
    assert not bad.passed


def test_twice_the_ttft_fails_the_ttft_gate_and_only_it() -> None:
    readings = {r.gate: r for r in judge(pool(200, ttft=0.18), pool(200, ttft=0.09), Gates())}
    assert not readings["ttft_p99"].passed
    assert readings["ttft_p99"].canary > 1.5 * readings["ttft_p99"].stable  # type: ignore[operator]
    assert readings["errors"].passed
    assert readings["itl_p50"].passed


def test_an_absolute_slo_holds_even_when_stable_is_as_slow() -> None:
    readings = {
        r.gate: r for r in judge(pool(50, ttft=0.7), pool(50, ttft=0.7), Gates(ttft_p99_slo=0.4))
    }
    assert readings["ttft_p99"].passed  # no worse than stable
    assert not readings["ttft_p99_slo"].passed  # but worse than the SLO


def test_nothing_to_judge_passes() -> None:
    readings = judge(PoolCounts(), PoolCounts(), Gates(min_agreement=0.9))
    assert all((r.passed and r.limit is None) or r.gate == "probes" for r in readings)
    assert all(r.passed for r in readings)


def test_the_probe_gate_is_the_share_of_identical_tokens() -> None:
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert agreement([1, 2, 3, 4], [1, 2, 9, 9]) == 0.5
    assert agreement([1, 2], [1, 2, 3, 4]) == 0.5  # a shorter answer differs where it lacks
    assert agreement([], []) == 1.0
    gates = Gates(min_agreement=0.9)
    probes = judge(pool(100), pool(100), gates, agreement=0.5)[-1]
    assert probes.gate == "probes"
    assert not probes.passed


def test_errors_that_break_the_gate_whatever_follows_are_a_certain_breach() -> None:
    gates, stable = Gates(error_margin=0.02), pool(1000, 0)
    # 100 requests are wanted; at 2 % at most 2 errors may come: the third settles it.
    assert not certain_error_breach(pool(10, 2), stable, gates, 100)
    assert certain_error_breach(pool(10, 3), stable, gates, 100)
    assert not certain_error_breach(pool(10, 3), PoolCounts(), gates, 100)  # stable idle


PLAN = Plan("chat", "v1", "v2", steps=(5.0, 50.0, 100.0), hold_s=60.0, min_requests=100)


def test_a_step_holds_until_its_time_and_its_requests_are_in() -> None:
    few = decide(PLAN, 0, 90.0, pool(40), pool(800))
    assert (few.action, few.why) == ("hold", "40 of 100 canary requests")
    early = decide(PLAN, 0, 20.0, pool(150), pool(3000))
    assert (early.action, early.hold_left_s) == ("hold", 40.0)


def test_a_healthy_canary_advances_step_by_step_then_is_promoted() -> None:
    weights = [PLAN.weights(0)]
    step = 0
    while True:
        v = decide(PLAN, step, 61.0, pool(150), pool(3000))
        if v.action == "promote":
            break
        assert v.action == "advance"
        assert v.step == step + 1
        step = v.step
        weights.append(PLAN.weights(step))
    assert weights == [{"v1": 95.0, "v2": 5.0}, {"v1": 50.0, "v2": 50.0}, {"v1": 0.0, "v2": 100.0}]
    assert PLAN.promoted() == {"v2": 100.0}


def test_an_advance_says_which_step_passed_counting_from_1() -> None:
    """Issue 54: "step 1 of 3 passed" beside the step it advanced to, 1 counted from 0: the
    texts count from 1 and name each step's share, the data's index stays one."""
    v = decide(PLAN, 0, 61.0, pool(150), pool(3000))
    assert (v.action, v.step) == ("advance", 1)
    assert v.why == "step 1 of 3 (5 %) passed; on to step 2"
    assert PLAN.step_name(1) == "step 2 of 3 (50 %)"


def test_a_breach_aborts_at_once_with_the_failed_gate() -> None:
    v = decide(PLAN, 1, 5.0, pool(120, ttft=0.18), pool(1000, ttft=0.09))
    assert v.action == "abort"
    assert v.why == "gate(s) failed: ttft_p99"
    assert [r.gate for r in v.breaches] == ["ttft_p99"]
    assert PLAN.rolled_back() == {"v1": 100.0, "v2": 0.0}


def test_errors_abort_before_the_requests_are_in_when_certain() -> None:
    v = decide(PLAN, 0, 5.0, pool(20, errors=5), pool(1000, errors=5))
    assert v.action == "abort"
    slow = decide(PLAN, 0, 5.0, pool(20, ttft=0.7), pool(1000))  # a latency breach waits
    assert slow.action == "hold"


def test_a_paused_rollout_holds_but_a_breach_still_aborts() -> None:
    assert decide(PLAN, 0, 600.0, pool(500), pool(500), paused=True).action == "hold"
    assert decide(PLAN, 0, 600.0, pool(500, 100), pool(500), paused=True).action == "abort"


@pytest.mark.parametrize(
    ("plan", "says"),
    [
        (Plan("a", "v1", "v1"), "two pools"),
        (Plan("a", "v1", "v2", steps=(5.0, 50.0)), "the last be 100"),
        (Plan("a", "v1", "v2", steps=(50.0, 5.0, 100.0)), "must rise"),
        (Plan("a", "v1", "v2", steps=(0.0, 100.0)), "above 0"),
        (Plan("a", "v1", "v2", hold_s=0.0), "hold_s"),
        (Plan("a", "v1", "v2", gates=Gates(ttft_p99_factor=0.5)), "ttft_p99_factor"),
        (Plan("a", "v1", "v3"), "unknown pool(s): v3"),
    ],
)
def test_a_bad_plan_is_refused_saying_why(plan: Plan, says: str) -> None:
    with pytest.raises(PlanError, match=says.replace("(", r"\(").replace(")", r"\)")):
        plan.check({"v1": object(), "v2": object()})
