"""The idle and stall watchdog, driven by hand: ``sweep(now)`` is the whole decision."""

from __future__ import annotations

from backends.upstream.idle import IdleWatchdog


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


def test_new_requests_without_a_byte_do_not_hide_a_stall_and_are_cut_with_it() -> None:
    """A hung engine still takes requests (their heads arrive) and answers none: they must
    not count as progress, and they are cut with the stalled streams (nothing reached their
    clients, so they are retried elsewhere)."""
    stalled: list[str] = []
    dog = IdleWatchdog(100.0, stall_after=5.0, on_stall=stalled.append, clock=lambda: 0.0)
    old = dog.watch(lambda: None, backend="a")
    old.activity = 4
    dog.sweep(1.0)  # old stands still from t=1
    new = [dog.watch(lambda: None, backend="a") for _ in range(3)]  # heads at t=0 (clock)
    fired = dog.sweep(6.5)
    assert stalled == ["a"]
    assert {id(w) for w in fired} == {id(old)} | {id(w) for w in new}


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


def test_a_stalled_backends_next_request_that_gets_no_byte_is_a_stall_again() -> None:
    """The circuit's trial after a stall gets its head and nothing more: that is a stall
    (without it, the trial would wait for the idle timeout). One byte clears the suspicion."""
    stalled: list[str] = []
    dog = IdleWatchdog(100.0, stall_after=5.0, on_stall=stalled.append, clock=lambda: 0.0)
    w = dog.watch(lambda: None, backend="a")
    w.activity = 1
    dog.sweep(0.0)
    dog.sweep(5.0)
    assert stalled == ["a"]
    clock = [20.0]
    dog._clock = lambda: clock[0]
    trial = dog.watch(lambda: None, backend="a")  # no byte ever
    dog.sweep(24.0)
    assert stalled == ["a"]
    assert dog.sweep(25.0) == [trial]
    assert stalled == ["a", "a"]
    clock[0] = 40.0
    healthy = dog.watch(lambda: None, backend="a")
    healthy.activity = 1
    dog.sweep(41.0)  # a byte: a is no longer suspect
    slow_prefill = dog.watch(lambda: None, backend="a")
    healthy.activity = 2
    dog.sweep(44.0)
    healthy.activity = 3
    dog.sweep(47.0)
    assert slow_prefill.fired is False  # waiting for a first byte is fine again


def test_a_stream_its_client_holds_back_is_neither_idle_nor_a_stall() -> None:
    cut: list[str] = []
    stalled: list[str] = []
    dog = IdleWatchdog(10.0, stall_after=5.0, on_stall=stalled.append, clock=lambda: 0.0)
    slow_reader = dog.watch(lambda: cut.append("slow_reader"), backend="a")
    slow_reader.activity += 3  # begun
    dog.sweep(1.0)
    slow_reader.held = True  # its client stopped reading: the relay stopped reading the backend
    for t in range(2, 30):
        assert dog.sweep(float(t)) == []
    assert stalled == []
    assert cut == []
    slow_reader.held = False  # the client drained: the clock runs again from the last sweep (29)
    assert dog.sweep(30.0) == []
    assert dog.sweep(33.5) == []
    assert dog.sweep(34.5) == [slow_reader]  # 5 s on with nothing from the backend: a stall
    assert stalled == ["a"]


def test_a_held_stream_does_not_hide_its_backends_stall() -> None:
    stalled: list[str] = []
    dog = IdleWatchdog(100.0, stall_after=5.0, on_stall=stalled.append, clock=lambda: 0.0)
    held = dog.watch(lambda: None, backend="a")
    still = dog.watch(lambda: None, backend="a")
    for w in (held, still):
        w.activity += 1
    dog.sweep(1.0)
    held.held = True
    fired = dog.sweep(6.5)  # "still" stood still 5.5 s; the held one says nothing either way
    assert stalled == ["a"]
    assert {id(w) for w in fired} == {id(held), id(still)}
