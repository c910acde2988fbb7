"""What a replica makes of the log it finds (``gateway.fleet.epoch``): pure, plain calls."""

from __future__ import annotations

from gateway.fleet.changes import Position
from gateway.fleet.epoch import judge, leader, new_epoch, newer

OLD, NOW = new_epoch(1_000.0), new_epoch(2_000.0)
P1, P2 = Position(10, 0), Position(20, 0)


def test_epochs_sort_by_when_they_were_made() -> None:
    assert newer(NOW, OLD)
    assert not newer(OLD, NOW)
    assert newer(OLD, None)
    assert not newer(None, OLD)


def test_the_log_a_replica_followed_is_ok_at_or_past_what_it_applied() -> None:
    assert judge(NOW, P1, NOW, P2) == "ok"
    assert judge(NOW, P2, NOW, P2) == "ok"
    assert judge(NOW, None, NOW, None) == "ok"  # nothing applied, nothing written


def test_a_log_gone_older_or_rewound_is_lost() -> None:
    assert judge(NOW, P1, None, None) == "lost"  # Redis restarted empty
    assert judge(NOW, P1, OLD, P2) == "lost"  # an older copy put back
    assert judge(NOW, P2, NOW, P1) == "lost"  # the same log, behind what was applied
    assert judge(NOW, P2, NOW, None) == "lost"  # the same epoch, its entries gone
    assert judge(None, None, None, None) == "lost"  # nothing yet: given an epoch the same way


def test_a_newer_log_or_one_joined_for_the_first_time_is_adopted() -> None:
    assert judge(OLD, P2, NOW, P1) == "adopt"
    assert judge(None, None, NOW, P2) == "adopt"


def test_a_log_from_before_epochs_is_claimed_by_a_replica_that_knows_none() -> None:
    assert judge(None, None, None, P1) == "claim"
    assert judge(NOW, P1, None, P1) == "lost"  # one that knew an epoch: it was taken away


def test_the_replica_furthest_ahead_heals_ties_to_the_smallest_id() -> None:
    assert leader([("r0", NOW, P1), ("r1", NOW, P2), ("r2", None, None)]) == "r1"
    assert leader([("r1", NOW, P2), ("r0", NOW, P2)]) == "r0"
    assert leader([("r0", OLD, P2), ("r1", NOW, P1)]) == "r1"  # a newer log before a position
    assert leader([("r2", None, None), ("r1", None, None)]) == "r1"  # a new fleet
    assert leader([]) is None
