"""The soak's invariants of admin changes under Redis faults (``loadtest.soak.changes``), on
synthetic records: each can pass, and each fails on the records of the lie it is there for."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from loadtest.soak.changes import (
    Call,
    KeyedChange,
    LogLoss,
    Outage,
    ViewRead,
    check_answers,
    check_log_losses,
    check_replica_logs,
    check_views,
    differs,
    drift,
    fleet_state,
    tracebacks,
)
from loadtest.soak.report import markdown

KEY = "soak-pause-0-made"


def call(status: int = 200, through: int = 0, **kw: Any) -> Call:
    fields: dict[str, Any] = {"through": through, "at": 10.0, "status": status, "change_id": KEY}
    return Call(**(fields | kw))


def unknown(through: int = 0) -> Call:
    return call(202, through, state="unknown")


def refused(through: int = 0, code: str = "fleet_log_unavailable") -> Call:
    return call(503, through, code=code)


def change(*calls: Call, **kw: Any) -> KeyedChange:
    """A change that settled applied on both replicas, whose repeat was answered as a replay."""
    fields: dict[str, Any] = {
        "key": KEY,
        "what": 'POST /admin/keys {"name": "soak-pause-0"}',
        "phase": "pause",
        "calls": calls or (call(),),
        "settled": ("applied", "applied"),
        "effect_settled": (True, True),
        "repeat": call(200, 1, replayed=True),
        "fates": ("applied", "applied"),
        "effect": (True, True),
        "entries": 1,
    }
    return KeyedChange(**(fields | kw))


def not_applied(*calls: Call, **kw: Any) -> KeyedChange:
    """A change that settled not applied anywhere, then was made by its repeat."""
    fields: dict[str, Any] = {
        "settled": ("not_applied", "not_applied"),
        "effect_settled": (False, False),
        "repeat": call(200, 1),
    }
    return change(*calls, **(fields | kw))


# -- every answer is what every replica applied -----------------------------------------------


def test_two_calls_caught_in_a_paused_redis_applied_once_and_replayed_after() -> None:
    v = check_answers([change(unknown(0), unknown(1))], planned_phases=1)
    assert v.passed, v.why
    assert v.figures["answers"] == {"unknown": 2}
    assert v.figures["replayed_repeats"] == 1


def test_a_change_refused_while_redis_was_away_is_applied_by_its_repeat_alone() -> None:
    dead = not_applied(refused(0), refused(1, "fleet_log_lost"), phase="restart")
    assert check_answers([dead], planned_phases=1).passed
    # Its fate was unknown when asked: it may have been written or not, both are true.
    assert check_answers([not_applied(unknown(0))], planned_phases=1).passed


def test_a_503_for_a_change_that_was_applied_is_a_lie() -> None:
    """The issue's first finding: "nothing was changed", and then it was, everywhere."""
    v = check_answers([change(refused(0))], planned_phases=1)
    assert not v.passed
    assert "answered 503 (not written), but applied" in v.why


def test_a_200_for_a_change_not_applied_everywhere_fails() -> None:
    assert "answered 200, but not_applied" in not_applied(call()).problems()[0]
    split = change(call(), settled=("applied", "pending"))
    assert any("not settled alike" in p for p in split.problems())
    hidden = change(call(), effect_settled=(True, False))
    assert any("state showed [True, False]" in p for p in hidden.problems())
    pending = change(call(202, state="pending"), settled=("not_applied", "not_applied"))
    assert any("202 pending" in p for p in pending.problems())


def test_a_repeat_applied_twice_or_replayed_for_nothing_fails() -> None:
    again = change(call(), repeat=call(200, 1), entries=2)
    problems = again.problems()
    assert "the repeat of a change applied was applied again" in problems
    assert "2 entries with its id in the audit trail" in problems
    ghost = not_applied(refused(), repeat=call(200, 1, replayed=True))
    assert "the repeat of a change not_applied was answered as a replay" in ghost.problems()
    twice = change(call(), call(through=1))
    assert "2 calls applied it afresh (none replayed)" in twice.problems()
    echo = change(refused(), call(through=1, replayed=True))
    assert any("replay of a change no call answered written" in p for p in echo.problems())


def test_a_change_made_before_the_log_was_lost_keeps_its_id_but_not_its_entries() -> None:
    before = change(call(), phase="before_restart", entries=None)
    assert before.problems() == []
    forgotten = replace(before, repeat=call(409, 1, code="key_exists"))
    assert "the repeat was answered 409" in forgotten.problems()


def test_no_answer_or_another_id_fails() -> None:
    assert any("no answer (0)" in p for p in change(unknown(), call(0, 1)).problems())
    assert any("no answer (500)" in p for p in change(call(500)).problems())
    other = change(call(change_id="chg_123"))
    assert "answered the id 'chg_123' for the key 'soak-pause-0-made'" in other.problems()


def test_the_repeat_must_leave_the_change_applied_everywhere() -> None:
    lost = not_applied(refused(), fates=("applied", "not_applied"), effect=(True, False))
    problems = lost.problems()
    assert any("not applied everywhere" in p for p in problems)
    assert any("state showed [True, False]" in p for p in problems)


def test_no_change_under_a_redis_fault_fails_when_one_was_planned() -> None:
    assert not check_answers([], planned_phases=2).passed
    assert check_answers([], planned_phases=0).passed
    v = check_answers([change(), change(refused())], planned_phases=2)
    assert not v.passed
    assert v.figures["problems"] == [
        'POST /admin/keys {"name": "soak-pause-0"} (soak-pause-0-made): '
        "answered 503 (not written), but applied"
    ]


# -- the views ----------------------------------------------------------------------------------

PATHS = ("/admin/replicas", "/admin/keys")
PAUSE = Outage("redis_pause", 50.0, 55.0)


def reads(**at: tuple[int, bool]) -> list[ViewRead]:
    """Every path of both replicas read every second from 45 to 60 s: 200, stale while Redis
    is away; ``at``: ``r<replica>_<path>_<t>`` -> (status, stale) instead."""
    out = []
    for t in range(45, 60):
        for r in (0, 1):
            for path in PATHS:
                status, stale = at.get(f"r{r}_{path.rsplit('/', 1)[1]}_{t}", (200, 50 <= t < 55))
                out.append(ViewRead(r, path, float(t), t + 0.5, status, stale))
    return out


def test_views_answered_200_throughout_and_stale_while_redis_was_away() -> None:
    v = check_views(reads(), [PAUSE], replicas=2)
    assert v.passed, v.why
    assert v.figures["while_away"] == 20


def test_a_view_failing_or_fresh_while_redis_was_away_fails() -> None:
    v = check_views(reads(r1_replicas_52=(500, False)), [PAUSE], replicas=2)
    assert not v.passed
    assert "1 of 60 reads not answered 200" in v.why
    v = check_views(reads(r0_keys_53=(200, False)), [PAUSE], replicas=2)
    assert "1 reads while Redis was away not marked stale" in v.why
    assert v.figures["examples"][0]["path"] == "/admin/keys"


def test_a_read_that_straddles_the_outage_need_not_be_stale() -> None:
    straddling = [*reads(), ViewRead(0, "/admin/keys", 54.8, 55.2, 200, False)]
    assert check_views(straddling, [PAUSE], replicas=2).passed


def test_every_view_of_every_replica_must_have_been_read_while_redis_was_away() -> None:
    v = check_views(reads(), [Outage("redis_kill", 70.0, 75.0)], replicas=2)
    assert not v.passed
    assert "never read while Redis was away: /admin/keys on replica 0" in v.why
    assert not check_views(reads(), [], replicas=2).passed


# -- a lost log, healed -------------------------------------------------------------------------


def state(**kw: Any) -> dict[str, Any]:
    backends = {"backends": [{"id": "gpu-a", "draining": False, "health": "up", "load": 3}]}
    policy = {"policy": "least_load", "weights": {"active": 1.0, "queue": 4.0, "kv": 0.5}}
    aliases = {
        "aliases": [{"alias": "chat", "weights": {"stable": 95.0, "canary": 5.0}}],
        "pools": {"stable": {"model": "llama", "drained": False}},
    }
    budget = {"source": "key", "tokens_per_day": 10**9, "periods": {"day": {"spent": 21}}}
    keys = {"keys": [{"name": "soak-budget", "tier": "default", "budget": budget}]}
    return fleet_state(backends, policy, aliases, keys) | kw


def test_the_state_of_a_replica_is_what_changes_set_not_its_figures() -> None:
    busy = fleet_state(
        {"backends": [{"id": "gpu-a", "draining": False, "health": "down", "load": 9}]},
        {"policy": "least_load", "weights": {"active": 1.0, "queue": 4.0, "kv": 0.5}},
        {
            "aliases": [{"alias": "chat", "weights": {"stable": 95.0, "canary": 5.0}}],
            "pools": {"stable": {"model": "llama", "drained": False}},
        },
        {
            "keys": [
                {
                    "name": "soak-budget",
                    "tier": "default",
                    "budget": {"source": "key", "tokens_per_day": 10**9, "periods": {}},
                }
            ]
        },
    )
    assert busy == state()
    assert state()["keys"]["soak-budget"]["budget"] == {"source": "key", "tokens_per_day": 10**9}
    assert state(policy="prefix_affinity") != state()


def loss(**kw: Any) -> LogLoss:
    fields: dict[str, Any] = {
        "at": 72.8,
        "restarts": 1,
        "before": (state(), state()),
        "after": (state(), state()),
        "losses": (1, 1),
        "flagged": (1, 1),
        "healed": 1,
        "healed_after": 6.2,
        "spent_before": 21,
        "spent_after": (21, 21),
    }
    return LogLoss(**(fields | kw))


def test_an_empty_restart_flagged_everywhere_and_healed_once_to_the_same_state_passes() -> None:
    v = check_log_losses([loss()], planned=1)
    assert v.passed, v.why
    assert "whole again after 6.2 s" in v.why
    assert check_log_losses([loss(), loss(restarts=2, losses=(2, 2))], planned=2).passed


def test_a_state_lost_with_the_log_fails() -> None:
    """The issue's third finding: a replica back on its file's state, the others on theirs."""
    split = loss(after=(state(), state(keys={})))
    v = check_log_losses([split], planned=1)
    assert not v.passed
    assert "replica(s) [1]: state after != before (differs in keys)" in v.why
    assert "unread" in loss(after=(state(), None)).problems()[0]


def test_a_loss_not_flagged_everywhere_or_healed_twice_fails() -> None:
    problems = loss(losses=(1, 0), flagged=(1, 0), healed=2).problems()
    assert "replica(s) [1]: losses [1, 0] < 1" in problems
    assert "replica(s) [1] logged no fleet_log_lost" in problems
    assert "healed 2 times (fleet_log_healed), not once" in problems
    assert "losses [1, 1] < 2" in loss(restarts=2).problems()[0]
    assert "not whole again" in loss(healed_after=None).problems()[0]


def test_a_replica_seen_on_another_state_while_the_log_was_healed_fails() -> None:
    """Adopting the healed log must not pass through the file's state: a run-time key gone for
    a moment is a moment of 401s for its callers."""
    assert loss(sampled=(120, 118)).problems() == []
    blip = loss(sampled=(120, 118), drifted=((81.66, 1, "keys, weights"),))
    assert blip.problems() == [
        "replica(s) [1] showed another state while the log was lost and healed: 1 of 238 "
        "reads, the first at 81.66 s on replica 1 (keys, weights)"
    ]
    assert differs(state(), state(weights={"active": 2.0})) == ["weights"]
    assert differs(state(), None) == []  # unread: nothing to judge
    assert drift(state(), state(policy="random")) == 'policy: "least_load" -> "random"'
    assert drift(state(), state()) == ""


def test_a_budget_spent_count_reset_by_the_restart_fails() -> None:
    assert "a budget's spent 21 became [21, 0]" in loss(spent_after=(21, 0)).problems()
    assert loss(spent_after=(25, 21)).problems() == []  # spent meanwhile: more, never less


def test_every_planned_empty_restart_must_be_measured() -> None:
    assert not check_log_losses([], planned=1).passed
    assert check_log_losses([], planned=0).passed


# -- the replicas' logs -----------------------------------------------------------------------


def line(event: str, **kw: Any) -> str:
    return json.dumps({"event": event, "level": "warning", **kw})


def test_clean_logs_with_one_stale_line_per_outage_pass() -> None:
    logs = {
        "gateway-0": "\n".join([line("fleet_log_lost"), line("admin_views_stale"), "not json"]),
        "gateway-1": line("admin_views_stale"),
    }
    v = check_replica_logs(logs, outages=2)
    assert v.passed, v.why
    assert v.figures["admin_views_stale"] == {"gateway-0": 1, "gateway-1": 1}


def test_a_traceback_in_a_replica_log_fails() -> None:
    logged = line("admin_error", exception="Traceback (most recent call last):\n  ...")
    printed = "Traceback (most recent call last):\n  File ...\nTimeoutError"
    assert len(tracebacks(f"{line('ok')}\n{logged}\n{printed}")) == 2
    v = check_replica_logs({"gateway-0": logged, "gateway-1": printed}, outages=2)
    assert not v.passed
    assert "gateway-0: 1 traceback(s)" in v.why
    assert "gateway-1: 1 traceback(s)" in v.why


def test_a_stale_line_per_call_rather_than_per_outage_fails() -> None:
    noisy = "\n".join(line("admin_views_stale") for _ in range(5))
    v = check_replica_logs({"gateway-0": noisy}, outages=2)
    assert not v.passed
    assert "5 admin_views_stale lines for 2 Redis outages" in v.why
    assert not check_replica_logs({}, outages=0).passed


# -- the report -------------------------------------------------------------------------------


def test_the_report_lists_each_change_and_each_empty_restart() -> None:
    answers = check_answers([change(unknown(0), unknown(1))], planned_phases=1)
    healed = check_log_losses([loss()], planned=1)
    doc = {
        "title": "t",
        "out": "/tmp/x",
        "wall_s": 1.0,
        "passed": True,
        "invariants": [answers.to_json(), healed.to_json()],
        "requests": {"total": 0, "by_outcome": {}},
        "faults": {"windows": []},
        "memory": {},
        "limits_probes": [],
    }
    text = markdown(doc)
    assert (
        '| pause | POST /admin/keys {"name": "soak-pause-0"} | 202 unknown (r0), 202 unknown (r1) '
        "| applied | 200 replayed (r1) | 1 |" in text
    )
    assert "| 72.8 | [1, 1] | 1 | 6.2 | True | 21 / [21, 21] |" in text
