"""The idle and stall watchdog, driven by hand: ``sweep(now)`` is the whole decision."""

from __future__ import annotations

from backends.idle import IdleWatchdog


def test_a_stream_idle_for_the_timeout_is_cut_and_a_moving_one_is_not() -> None:
    cut: list[str] = []
    dog = IdleWatchdog(10.0, clock=lambda: 0.0)
    idle = dog.watch(lambda: cut.append("idle"))
    moving = dog.watch(lambda: cut.append("moving"))
    for t in range(1, 10):
        moving.activity += 1
        assert dog.sweep(float(t)) == []
    moving.activity += 1
    assert dog.sweep(10.0) == [idle]
    assert cut == ["idle"]
    assert (idle.fired, idle.stalled) == (True, False)
    assert len(dog) == 1


def test_a_backend_whose_every_stream_stands_still_is_stalled() -> None:
    cut: list[str] = []
    stalled: list[str] = []
    dog = IdleWatchdog(100.0, stall_after=5.0, on_stall=stalled.append, clock=lambda: 0.0)
    a1 = dog.watch(lambda: cut.append("a1"), backend="a")
    a2 = dog.watch(lambda: cut.append("a2"), backend="a")
    b1 = dog.watch(lambda: cut.append("b1"), backend="b")
    for w in (a1, a2, b1):
        w.activity += 3  # every stream has begun
    dog.sweep(1.0)
    a2.activity += 1  # a2 still moves at t=2: a is not stalled at t=6
    dog.sweep(2.0)
    b1.activity += 1
    dog.sweep(5.5)
    assert stalled == []
    fired = dog.sweep(7.1)  # a1 still since t=1, a2 since t=2: every stream of a
    assert {id(w) for w in fired} == {id(a1), id(a2)}
    assert stalled == ["a"]
    assert sorted(cut) == ["a1", "a2"]
    assert a1.stalled
    assert a2.stalled
    assert not b1.fired


def test_streams_that_have_not_begun_alone_are_no_stall() -> None:
    """A backend still prefilling every request it has (no byte yet) is not stalled: a long
    prompt takes time. Its streams fall to the idle timeout only."""
    stalled: list[str] = []
    dog = IdleWatchdog(100.0, stall_after=5.0, on_stall=stalled.append, clock=lambda: 0.0)
    dog.watch(lambda: None, backend="a")
    dog.sweep(50.0)
    assert stalled == []


def test_stall_detection_is_off_at_zero() -> None:
    stalled: list[str] = []
    dog = IdleWatchdog(100.0, stall_after=0.0, on_stall=stalled.append, clock=lambda: 0.0)
    w = dog.watch(lambda: None, backend="a")
    w.activity = 1
    dog.sweep(0.5)
    dog.sweep(60.0)
    assert stalled == []
    assert dog.interval == 1.0
