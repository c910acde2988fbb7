"""The race of a hedge: who takes the client, and who is told it lost."""

from __future__ import annotations

from gateway.hedge import Race


def test_the_first_to_claim_takes_the_client_and_the_others_are_ended() -> None:
    race = Race()
    first, hedge = race.join(), race.join()
    assert race.rivalled(first)
    assert race.rivalled(hedge)
    assert hedge.take()  # its first bytes came first
    assert race.winner is hedge
    assert not hedge.armed  # from now on the stream is the client's
    assert first.cause is not None  # ended: its wait fails at once
    assert not first.take()  # and if its bytes came meanwhile, they are not sent
    assert not race.rivalled(first)


def test_an_attempt_that_ended_is_no_rival() -> None:
    race = Race()
    first, hedge = race.join(), race.join()
    hedge.disarm()  # it ended (failed, settled) before any first bytes
    assert not race.rivalled(first)
    assert race.rivalled(hedge)
    assert first.take()
    assert hedge.cause is not None or not hedge.armed


def test_an_interrupt_outside_a_race_always_takes() -> None:
    from backends.upstream import Interrupt

    alone = Interrupt()
    assert alone.take()
    assert not alone.armed
