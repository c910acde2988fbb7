"""The race of a hedge: who takes the client, and who is told it lost."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from backends.errors import FirstTokenLate
from gateway.request.attempt import _rescue_plan
from gateway.request.hedge import HedgeBudget, Race
from policies.capabilities import Capabilities


def test_the_first_to_claim_takes_the_client_and_the_others_are_ended() -> None:
    race = Race()
    first, hedge = race.join("a"), race.join("b")
    assert race.rivalled(first)
    assert race.rivalled(hedge)
    assert hedge.take()  # its first bytes came first
    assert race.winner is hedge
    assert not hedge.armed  # from now on the stream is the client's
    assert first.cause is not None  # ended: its wait fails at once, naming its backend
    assert isinstance(first.cause.error, FirstTokenLate)
    assert "backend a: another backend's first token came first" in str(first.cause.error)
    assert not first.take()  # and if its bytes came meanwhile, they are not sent
    assert not race.rivalled(first)


def test_the_race_says_once_when_it_is_decided() -> None:
    race = Race()
    calls: list[int] = []
    race.decided = lambda: calls.append(1)
    first, hedge = race.join("a"), race.join("b")
    assert calls == []
    assert first.take()
    assert not hedge.take()
    assert calls == [1]


def test_an_attempt_that_ended_is_no_rival() -> None:
    race = Race()
    first, hedge = race.join("a"), race.join("b")
    hedge.disarm()  # it ended (failed, settled) before any first bytes
    assert not race.rivalled(first)
    assert race.rivalled(hedge)
    assert first.take()
    assert hedge.cause is not None or not hedge.armed


def test_an_interrupt_outside_a_race_always_takes() -> None:
    from backends.upstream.client import Interrupt

    alone = Interrupt()
    assert alone.take()
    assert not alone.armed


def test_an_attempt_that_joins_after_the_race_was_won_has_lost() -> None:
    race = Race()
    assert race.join("b").take()
    late = race.join("b")
    assert late.cause is not None
    assert not late.take()


def _plan(role: str | None, response_id: str | None, hedges: bool) -> tuple[float | None, Any]:
    policy: Any = SimpleNamespace(
        hedges=hedges, hedge_budget=0.1, first_token_deadline=lambda backend, ttft: 3 * ttft
    )
    t: Any = SimpleNamespace(
        call=SimpleNamespace(streamed=True, response_id=response_id),
        step=SimpleNamespace(role=role, policy=policy, caps=Capabilities.of(policy)),
        may_retry=True,
        lease=SimpleNamespace(backend=SimpleNamespace(id="a")),
        expected=SimpleNamespace(predicted=SimpleNamespace(ttft=0.1)),
        first_token_within=None,
    )
    return _rescue_plan(t), t.first_token_within


def test_a_late_stream_is_hedged_only_where_a_copy_may_run_beside_it() -> None:
    hedge, moved = _plan(None, None, hedges=True)
    assert hedge == pytest.approx(0.3)
    assert moved is None
    # A decode step (its KV cache is pulled once) and a stored response (one home): moved.
    for role, rid in (("decode", None), (None, "resp_1")):
        hedge, moved = _plan(role, rid, hedges=True)
        assert hedge is None
        assert moved == pytest.approx(0.3)
    hedge, moved = _plan(None, None, hedges=False)  # the move is the mode
    assert hedge is None
    assert moved == pytest.approx(0.3)


def test_hedges_run_within_their_share_of_the_requests_in_flight() -> None:
    budget = HedgeBudget()
    one = budget.take(0.1, 5)  # one at least, however few are in flight
    assert one is not None
    assert budget.take(0.1, 5) is None
    assert budget.take(0.1, 25) is not None  # 2.5 allowed: a second
    assert budget.take(0.1, 25) is None
    one()
    one()  # given back once, however often it is called
    assert budget.running == 1
    assert budget.take(0.1, 25) is not None
    assert HedgeBudget().take(0.0, 1_000) is None  # a share of 0: no hedge at all
