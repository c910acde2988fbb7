"""The fleet's record of rollouts (pure): each change follows the last or is refused, a step
is made once whoever drives, a succeeded driver is refused, and the record survives its JSON."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gateway.fleet.figures import PoolCounts
from gateway.rollouts.plan import Plan, PlanError
from gateway.rollouts.state import RolloutError, Rollouts, Run, parse_plan, plan_fingerprint

PLAN = Plan("chat", "v1", "v2", steps=(10.0, 50.0, 100.0), hold_s=60.0, min_requests=10)
BASE = {"r0": {"v1": PoolCounts(100, 1, ((0.1, 90), (float("inf"), 100))), "v2": PoolCounts()}}


def started() -> Rollouts:
    return Rollouts().start(PLAN, at=1000.0).window("chat", 0, token=1, baseline=BASE)


def test_a_step_is_made_once_whoever_drives() -> None:
    r = started().advance("chat", 1, 1100.0, token=1)
    with pytest.raises(RolloutError, match="does not follow"):
        r.advance("chat", 1, 1101.0, token=2)  # the successor's repeat of the same step
    with pytest.raises(RolloutError, match="does not follow"):
        r.advance("chat", 3, 1101.0, token=1)  # nor one skipped
    r = r.advance("chat", 2, 1200.0, token=2)  # the successor goes on from the record
    run = r.get("chat")
    assert run is not None
    assert (run.step, run.step_began, run.token, run.weights) == (
        2,
        1200.0,
        2,
        {"v1": 0.0, "v2": 100.0},
    )


def test_a_succeeded_driver_is_refused() -> None:
    r = started().advance("chat", 1, 1100.0, token=5)
    with pytest.raises(RolloutError, match="succeeded"):
        r.advance("chat", 2, 1200.0, token=4)
    with pytest.raises(RolloutError, match="succeeded"):
        r.abort("chat", 1200.0, "gate", token=4)


def test_a_windows_start_is_set_once_a_step() -> None:
    r = started()
    with pytest.raises(RolloutError, match="set already"):
        r.window("chat", 0, token=1, baseline=BASE)
    run = r.advance("chat", 1, 1100.0, token=1).get("chat")
    assert run is not None
    assert run.baseline is None  # an advance without one leaves it for the driver to take


def test_promotion_only_from_the_last_step_and_then_nothing_more() -> None:
    r = started()
    with pytest.raises(RolloutError, match="not its last"):
        r.promote("chat", 1100.0, token=1)
    r = r.advance("chat", 1, 1100.0, token=1).advance("chat", 2, 1200.0, token=1)
    r = r.promote("chat", 1300.0, token=1, why="every step passed")
    run = r.get("chat")
    assert run is not None
    assert (run.status, run.weights) == ("promoted", {"v2": 100.0})
    with pytest.raises(RolloutError, match="under way"):
        r.abort("chat", 1400.0, "too late")
    assert r.start(PLAN, at=2000.0).get("chat") is not None  # a new rollout may begin


def test_refusals_count_steps_from_1_as_people_do() -> None:
    """Issue 54: the refusals said "at step 0" of the first step."""
    r = started()
    with pytest.raises(RolloutError, match=r"at step 1 of 3 \(10 %\), not its last"):
        r.promote("chat", 1100.0, token=1)
    with pytest.raises(RolloutError, match=r"^Step 3 does not follow step 1 of 3 \(10 %\)"):
        r.advance("chat", 2, 1100.0, token=1)
    with pytest.raises(RolloutError, match=r"^Step 1's window .* set already"):
        r.window("chat", 0, token=1, baseline=BASE)


def test_pause_resume_and_an_operators_abort() -> None:
    r = started().pause("chat", 1010.0, by="ops")
    with pytest.raises(RolloutError, match="paused"):
        r.advance("chat", 1, 1100.0, token=1)
    with pytest.raises(RolloutError, match="under way already"):
        r.start(PLAN, at=1020.0)
    r = r.resume("chat", 1030.0)
    with pytest.raises(RolloutError, match="not paused"):
        r.resume("chat", 1040.0)
    r = r.abort("chat", 1050.0, "the answers look wrong", by="ops")
    run = r.get("chat")
    assert run is not None
    assert run.status == "aborted"
    assert run.weights == {"v1": 100.0, "v2": 0.0}
    assert [e.action for e in run.history] == ["start", "pause", "resume", "abort"]


def test_the_record_survives_its_json() -> None:
    readings = ({"gate": "errors", "canary": 0.1, "stable": 0.0, "limit": 0.02, "passed": False},)
    r = started().advance("chat", 1, 1100.0, token=1, baseline=BASE)
    r = r.abort("chat", 1150.0, "gate(s) failed: errors", readings, token=1)
    again = Rollouts.parse(json.loads(json.dumps(r.doc())))
    assert again == r
    run = again.get("chat")
    assert isinstance(run, Run)
    assert run.history[-1].readings == readings


def test_a_plan_from_json_says_what_is_wrong() -> None:
    plan = parse_plan({"stable": "v1", "canary": "v2", "gates": {"ttft_p99_slo": None}}, "chat")
    assert (plan.alias, plan.steps, plan.gates.ttft_p99_slo) == ("chat", (1, 5, 25, 50, 100), None)
    for doc, says in (
        ([], "a JSON object"),
        ({"stable": "v1", "canary": "v2", "steps": "10,100"}, "list"),
        ({"stable": "v1", "canary": "v2", "min_requests": 1.5}, "whole number"),
        ({"stable": "v1", "canary": "v2", "gates": {"error_margin": None}}, "error_margin"),
        ({"stable": "v1", "canary": "v2", "gates": {"speed": 1}}, "gates"),
        ({"stable": "v1"}, "canary"),
        ({"alias": "other", "stable": "v1", "canary": "v2"}, "not 'chat'"),
    ):
        with pytest.raises(PlanError, match=says):
            parse_plan(doc, "chat")


def test_a_window_sums_each_replicas_counts_since_its_own_reading() -> None:
    from gateway.rollouts.driver import window

    began = {"r0": {"v2": PoolCounts(100, 5)}, "r1": {"v2": PoolCounts(40, 0)}}
    counted = {
        "r0": {"v2": PoolCounts(130, 6)},  # 30 more, one error
        "r2": {"v2": PoolCounts(12, 1)},  # joined since: all of its own
        # r1 left (killed; its report expired): its 40 were before the window anyway
    }
    w = window(counted, began, "v2")
    assert (w.requests, w.errors) == (30 + 12, 1 + 1)
    restarted = {"r0": {"v2": PoolCounts(9, 0)}}  # r0 restarted: counting from 0 again
    assert window(restarted, began, "v2").requests == 9


def test_a_configured_plan_is_started_once_and_each_of_a_files_plans_once() -> None:
    r = Rollouts().start(PLAN, 1000.0, "configuration", configured=True)
    assert not r.unstarted(PLAN)
    r = r.abort("chat", 1010.0, "aborted by an operator")
    assert not r.unstarted(PLAN)  # ended: still not again
    with pytest.raises(RolloutError, match="started already"):
        r.start(PLAN, 1020.0, configured=True)
    r = r.start(PLAN, 1020.0)  # an operator may run it again through the API
    changed = Plan("chat", "v1", "v2", steps=(50.0, 100.0))  # the file changed since
    assert not r.unstarted(changed)  # not while another rollout of the alias is under way
    r = r.abort("chat", 1030.0, "aborted by an operator")
    assert r.unstarted(changed)
    r = r.start(changed, 1040.0, "configuration", configured=True)
    assert r.configured["chat"] == (plan_fingerprint(PLAN), plan_fingerprint(changed))
    # A replica whose file still has the first plan does not start it again.
    r = r.abort("chat", 1050.0, "aborted by an operator")
    assert not r.unstarted(PLAN)
    runs, configured = json.loads(json.dumps([r.doc(), r.configured_doc()]))
    assert Rollouts.parse(runs, configured) == r
    # A replica of the version before configured plans reads the runs alone, as it wrote them.
    assert Rollouts.parse(runs) == replace(r, configured={})
