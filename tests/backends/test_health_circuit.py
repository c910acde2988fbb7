"""The pure state machines of backend health: probes, circuit breaker, retry, discovery diff."""

from __future__ import annotations

import random

import pytest

from backends.circuit import Circuit, CircuitBreaker, CircuitPolicy
from backends.discovery import backend_for, diff
from backends.health import Health, HealthPolicy, HealthTracker
from backends.pool import BackendPool
from backends.state import BackendSpec
from gateway.request.retry import RetryPolicy


def test_new_backend_is_unknown_until_its_first_probe() -> None:
    t = HealthTracker(HealthPolicy(fall=3, rise=2))
    assert t.state is Health.UNKNOWN
    assert t.probe_ok() is Health.UP


def test_unknown_backend_failing_its_first_probe_is_down() -> None:
    t = HealthTracker(HealthPolicy(fall=3, rise=2))
    assert t.probe_failed("refused") is Health.DOWN


def test_a_backend_never_up_comes_up_on_its_first_good_probe() -> None:
    t = HealthTracker(HealthPolicy(fall=3, rise=2))
    t.probe_failed("still loading")
    t.probe_failed("still loading")
    assert t.probe_ok() is Health.UP  # starting up is not flapping: no rise needed


def test_down_after_fall_consecutive_failures_up_after_rise_successes() -> None:
    t = HealthTracker(HealthPolicy(fall=3, rise=2))
    t.probe_ok()
    assert t.probe_failed("x") is Health.UP
    assert t.probe_ok() is Health.UP  # a success resets the count
    assert t.probe_failed("x") is Health.UP
    assert t.probe_failed("x") is Health.UP
    assert t.probe_failed("timeout") is Health.DOWN
    assert t.last_error == "timeout"
    assert t.probe_ok() is Health.DOWN  # one success is not enough to come back
    assert t.probe_failed("x") is Health.DOWN
    assert t.probe_ok() is Health.DOWN
    assert t.probe_ok() is Health.UP


def test_failing_scrapes_lower_the_bar_by_one_but_never_mark_down_alone() -> None:
    t = HealthTracker(HealthPolicy(fall=3, rise=2))
    t.probe_ok()
    assert t.probe_failed("x", scrape_failing=True) is Health.UP
    assert t.probe_failed("x", scrape_failing=True) is Health.DOWN
    one = HealthTracker(HealthPolicy(fall=1, rise=1))
    one.probe_ok()
    assert one.state is Health.UP  # scrapes alone (no probe failure) change nothing


def test_health_policy_validates() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        HealthPolicy(fall=0)


def breaker(**kw: float) -> CircuitBreaker:
    return CircuitBreaker(CircuitPolicy(**{"threshold": 3, "cooldown": 10.0, **kw}))  # type: ignore[arg-type]


def test_circuit_opens_after_threshold_consecutive_failures() -> None:
    c = breaker()
    for t in (0.0, 1.0):
        c.on_send(t)
        c.on_failure(t)
    c.on_send(2.0)
    c.on_success()  # a success in between resets the count
    for t in (3.0, 4.0):
        c.on_send(t)
        c.on_failure(t)
    assert c.state is Circuit.CLOSED
    c.on_send(5.0)
    c.on_failure(5.0)
    assert c.state is Circuit.OPEN
    assert not c.allows(5.0)
    assert not c.allows(14.9)


def test_half_open_lets_exactly_one_trial_through_and_success_closes() -> None:
    c = breaker(threshold=1)
    c.on_send(0.0)
    c.on_failure(0.0)
    assert c.allows(10.0)
    c.on_send(10.0)
    assert c.state is Circuit.HALF_OPEN
    assert not c.allows(10.1)  # the trial is in flight: nobody else
    c.on_success()
    assert c.state is Circuit.CLOSED
    assert c.allows(10.2)


def test_failed_trial_reopens_with_a_growing_cooldown_capped() -> None:
    c = breaker(threshold=1, cooldown=10.0, growth=2.0, max_cooldown=35.0)
    c.on_send(0.0)
    c.on_failure(0.0)
    assert c.current_cooldown == 10.0
    now = 0.0
    for expected in (20.0, 35.0, 35.0):
        now += c.current_cooldown
        assert c.allows(now)
        c.on_send(now)
        c.on_failure(now)
        assert c.state is Circuit.OPEN
        assert c.current_cooldown == expected
        assert not c.allows(now + expected - 0.01)
    now += c.current_cooldown
    c.on_send(now)
    c.on_success()
    assert c.state is Circuit.CLOSED
    c.on_send(now + 1)
    c.on_failure(now + 1)  # opening again afresh starts from the base cooldown
    assert c.current_cooldown == 10.0
    assert c.times_opened == 5


def test_a_stall_trips_the_circuit_at_once_and_repeated_stalls_grow_its_cooldown() -> None:
    c = breaker(threshold=5, cooldown=10.0, growth=2.0, max_cooldown=35.0)
    c.trip(0.0)  # no failures counted: a stall opens it by itself
    assert c.state is Circuit.OPEN
    assert c.current_cooldown == 10.0
    assert not c.allows(9.9)
    c.on_send(10.0)  # the trial stalls too
    c.trip(12.0)
    assert c.current_cooldown == 20.0
    c.on_send(32.0)
    c.on_success()  # a good trial: closed, and the next stall starts afresh
    c.trip(40.0)
    assert c.current_cooldown == 10.0


def test_a_stall_takes_a_backend_down_until_its_probes_and_its_circuit_let_it_back() -> None:
    clock = [0.0]
    pool = BackendPool(
        [BackendSpec(id="a", url="http://a")],
        stale_after=1.0,
        health=HealthPolicy(fall=3, rise=2),
        circuit=CircuitPolicy(cooldown=10.0),
        clock=lambda: clock[0],
    )
    pool.record_models("a", ["m"])
    pool.record_probe("a", ok=True)
    told: list[str] = []
    b = pool.get("a")
    assert b is not None
    b.down_watchers.add(lambda: told.append("down"))
    assert pool.record_stall("a", "stalled: none of its streams moved for 20 s")
    assert not pool.record_stall("a", "again")  # down already: once
    assert told == ["down"]  # a request waiting on it moves on
    assert b.health.state is Health.DOWN
    pool.record_probe("a", ok=True)
    pool.record_probe("a", ok=True)  # its /health answers: up again...
    assert b.health.state is Health.UP
    assert not pool.routable(b, clock[0])  # ...but not before its circuit's cooldown
    clock[0] = 10.0
    assert pool.routable(b, clock[0])


def test_abandoned_trial_gives_the_trial_back() -> None:
    c = breaker(threshold=1)
    c.on_send(0.0)
    c.on_failure(0.0)
    c.on_send(10.0)
    assert not c.allows(10.0)
    c.on_abandoned()
    assert c.state is Circuit.HALF_OPEN
    assert c.allows(10.0)


def test_backoff_grows_is_capped_and_jittered_within_bounds() -> None:
    p = RetryPolicy(backoff_base=0.1, backoff_factor=2.0, backoff_max=0.5, jitter=0.2)
    rng = random.Random(4)
    for n, base in ((1, 0.1), (2, 0.2), (3, 0.4), (4, 0.5), (9, 0.5)):
        waits = [p.backoff(n, rng) for _ in range(200)]
        assert min(waits) >= base * 0.8 - 1e-9
        assert max(waits) <= base * 1.2 + 1e-9
        assert max(waits) - min(waits) > base * 0.2  # really jittered


def test_may_retry_respects_attempts_and_deadline() -> None:
    p = RetryPolicy(max_attempts=3, deadline=1.0)
    assert p.may_retry(1, 0.0, 0.1)
    assert p.may_retry(2, 0.5, 0.1)
    assert not p.may_retry(3, 0.0, 0.1)
    assert not p.may_retry(1, 0.95, 0.1)


def test_discovery_diff_and_backend_ids() -> None:
    assert diff({"a", "b"}, {"b", "c"}) == ({"c"}, {"a"})
    v4 = backend_for("10.1.2.3", 8000, name="vllm:8000", scheme="http", api_key=None)
    assert (v4.id, v4.url, v4.source) == ("10.1.2.3:8000", "http://10.1.2.3:8000", "vllm:8000")
    v6 = backend_for("fd00::1", 8000, name="vllm:8000", scheme="https", api_key="k")
    assert (v6.id, v6.url, v6.api_key) == ("[fd00::1]:8000", "https://[fd00::1]:8000", "k")
