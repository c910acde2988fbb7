"""The latency tracker's fits: what they learn, how fast they forget, what they never predict."""

from __future__ import annotations

import random

import pytest

from policies import BackendSnapshot, Outcome, RouteFacts
from policies.latency import (
    TTFT_PRIOR,
    DecayingFit,
    LatencyConfig,
    LatencyTracker,
    Load,
    load_of,
    prompt_size,
)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def tracker(**cfg: float) -> tuple[LatencyTracker, Clock]:
    clock = Clock()
    return LatencyTracker(LatencyConfig(**cfg), clock=clock), clock  # type: ignore[arg-type]


def true_ttft(load: Load, speed: float = 1.0) -> float:
    """A backend whose TTFT is 30 ms + 40 ms per 1,000 uncached tokens + 80 ms per queued
    request + 2 ms per running sequence, all times ``speed``."""
    return speed * (0.03 + 0.04 * load.uncached / 1000 + 0.08 * load.queued + 0.002 * load.running)


def feed(
    t: LatencyTracker,
    clock: Clock,
    backend: str,
    n: int,
    *,
    speed: float = 1.0,
    itl: float | None = None,
    rng: random.Random | None = None,
    dt: float = 0.05,
) -> None:
    rng = rng or random.Random(1)
    for _ in range(n):
        load = Load(rng.uniform(0, 4000), rng.randrange(0, 6), rng.randrange(0, 16))
        ttft = true_ttft(load, speed)
        tokens = 64
        per = itl if itl is not None else speed * (0.01 + 0.001 * load.running)
        outcome = Outcome(
            ok=True,
            status=200,
            first_token_s=ttft,
            tokens=tokens,
            duration_s=ttft + per * (tokens - 1),
        )
        t.observe(backend, load, outcome, t.predict(backend, load))
        clock.t += dt


def test_a_fit_recovers_the_coefficients_of_noise_free_data() -> None:
    fit = DecayingFit(4)
    rng = random.Random(3)
    for i in range(200):
        x = (1.0, rng.uniform(0, 4), float(rng.randrange(6)), float(rng.randrange(16)))
        fit.add(x, 0.03 + 0.04 * x[1] + 0.08 * x[2] + 0.002 * x[3], now=i * 0.01, half_life=60)
    coef = fit.solve(TTFT_PRIOR[:4], ridge=1e-6)
    assert coef == pytest.approx((0.03, 0.04, 0.08, 0.002), abs=1e-4)


def test_slopes_are_never_negative_more_load_never_predicts_a_faster_answer() -> None:
    fit = DecayingFit(4)
    for i in range(50):
        q = float(i % 5)
        fit.add((1.0, 0.0, q, 0.0), 0.5 - 0.05 * q, now=0.0, half_life=10)  # faster when busier
    coef = fit.solve(TTFT_PRIOR[:4], ridge=0.1)
    assert coef[2] == 0.0
    assert all(c >= 0.0 for c in coef[1:])


def test_a_backend_learns_its_own_speed_and_predicts_it() -> None:
    t, clock = tracker()
    feed(t, clock, "slow", 300, speed=3.0)
    feed(t, clock, "fast", 300, speed=1.0, rng=random.Random(2))
    probe = Load(uncached=1000, queued=2, running=8)
    assert t.predict("slow", probe).ttft == pytest.approx(true_ttft(probe, 3.0), rel=0.1)
    assert t.predict("fast", probe).ttft == pytest.approx(true_ttft(probe, 1.0), rel=0.1)
    assert t.predict("slow", probe).itl == pytest.approx(3.0 * (0.01 + 0.008), rel=0.1)


def test_a_backend_that_slows_down_or_recovers_is_seen_within_a_few_half_lives() -> None:
    t, clock = tracker(half_life=5.0)
    probe = Load(uncached=500, queued=1, running=4)
    normal, slow = true_ttft(probe), true_ttft(probe, 3.0)
    feed(t, clock, "b", 400, speed=1.0)  # 20 s at normal speed (20 requests a second)
    assert t.predict("b", probe).ttft == pytest.approx(normal, rel=0.1)
    feed(t, clock, "b", 20, speed=3.0)  # one second three times slower: noticed
    assert t.predict("b", probe).ttft > 1.2 * normal
    feed(t, clock, "b", 180, speed=3.0)  # two half-lives: most of the way
    assert t.predict("b", probe).ttft > normal + 0.6 * (slow - normal)
    feed(t, clock, "b", 300, speed=3.0)  # five: there
    assert t.predict("b", probe).ttft == pytest.approx(slow, rel=0.15)
    feed(t, clock, "b", 200, speed=1.0)  # and it recovers as fast
    assert t.predict("b", probe).ttft < slow - 0.6 * (slow - normal)
    feed(t, clock, "b", 300, speed=1.0)
    assert t.predict("b", probe).ttft == pytest.approx(normal, rel=0.15)


def test_a_new_backend_is_predicted_like_the_fleet() -> None:
    t, clock = tracker()
    feed(t, clock, "a", 200, speed=2.0)
    probe = Load(uncached=1000, queued=1, running=4)
    assert t.predict("new", probe).ttft == pytest.approx(true_ttft(probe, 2.0), rel=0.1)


def test_a_backend_left_alone_drifts_back_to_the_fleets_figures() -> None:
    t, clock = tracker(half_life=2.0, memory=4.0)
    feed(t, clock, "slow", 200, speed=4.0)
    feed(t, clock, "fast", 200, speed=1.0, rng=random.Random(5))
    probe = Load(uncached=1000, queued=1, running=4)
    assert t.predict("slow", probe).ttft > 3 * t.predict("fast", probe).ttft
    # Only the fast one gets traffic from now on, for ten half-lives of the long memory.
    feed(t, clock, "fast", 400, speed=1.0, rng=random.Random(6), dt=0.1)
    # The slow one's own figures have faded: it is predicted as the fleet is now (fast), so
    # it gets traffic again and shows whether it recovered.
    assert t.predict("slow", probe).ttft == pytest.approx(t.predict("fast", probe).ttft, rel=0.25)


def test_solving_ahead_a_prediction_is_a_dot_product_from_the_last_solution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    t = LatencyTracker(LatencyConfig(), clock=clock, solve_ahead=True)
    feed(t, clock, "a", 50)
    feed(t, clock, "b", 50, speed=2.0, rng=random.Random(4))
    probe = Load(uncached=1000, queued=1, running=4)
    assert t.want_refresh()
    assert not t.want_refresh()  # one at a time: scheduled already
    clock.t += 0.3
    t.refresh()
    assert t.want_refresh()
    solves: list[int] = []
    real = DecayingFit.solve
    monkeypatch.setattr(DecayingFit, "solve", lambda self, *a: solves.append(1) or real(self, *a))
    before = t.predict("b", probe).ttft
    assert before > 1.5 * t.predict("a", probe).ttft
    feed(t, clock, "b", 20, speed=6.0, dt=0.03)  # b slows down: 0.6 s of answers
    assert t.predict("b", probe).ttft == before  # not solved on the way: the last solution
    assert solves == []
    t.refresh()  # the gateway's, while it waits on backends
    assert len(solves) == 6  # TTFT and ITL: the fleet's and b's (memory, recent); a's is young
    assert t.predict("b", probe).ttft > 1.2 * before
    solves.clear()
    clock.t += 0.5  # a's solution is past half the age limit (half_life / 4): solved, unchanged
    t.refresh()
    assert len(solves) == 4
    solves.clear()
    clock.t += 1.3  # no refresh for longer than the age limit: the prediction solves
    t.predict("a", probe)
    assert solves != []


def test_without_solving_ahead_a_prediction_solves_what_changed() -> None:
    t, clock = tracker()
    feed(t, clock, "b", 50)
    probe = Load(uncached=1000, queued=1, running=4)
    before = t.predict("b", probe).ttft
    feed(t, clock, "b", 20, speed=6.0, dt=0.03)
    assert t.predict("b", probe).ttft > 1.2 * before


def test_the_long_memory_keeps_what_the_recent_window_rarely_sees() -> None:
    t, clock = tracker(half_life=2.0, memory=60.0)
    rng = random.Random(7)
    for i in range(600):  # 60 s of short prompts, and a long one every 5 s
        uncached = 4000.0 if i % 50 == 0 else rng.uniform(0, 200)
        load = Load(uncached, 0, 2)
        ttft = 0.03 + 0.3 * uncached / 1000  # prefill costs 300 ms per 1,000 tokens here
        t.observe("b", load, Outcome(ok=True, status=200, first_token_s=ttft))
        clock.t += 0.1
    # The last long prompt was 4.9 s (2.5 recent half-lives) ago; the cost is remembered.
    long_prompt = Load(4000, 0, 2)
    assert t.predict("b", long_prompt).ttft == pytest.approx(0.03 + 1.2, rel=0.2)
    forgetful, clock2 = tracker(half_life=2.0, memory=2.0)
    rng = random.Random(7)
    for i in range(600):
        uncached = 4000.0 if i % 50 == 0 else rng.uniform(0, 200)
        ttft = 0.03 + 0.3 * uncached / 1000
        forgetful.observe(
            "b", Load(uncached, 0, 2), Outcome(ok=True, status=200, first_token_s=ttft)
        )
        clock2.t += 0.1
    assert forgetful.predict("b", long_prompt).ttft < t.predict("b", long_prompt).ttft


def test_the_prediction_error_is_the_error_of_what_was_predicted_before_learning() -> None:
    t, clock = tracker()
    load = Load(100, 0, 1)
    predicted = t.predict("b", load)
    observed = 2 * predicted.ttft
    t.observe("b", load, Outcome(ok=True, status=200, first_token_s=observed), predicted)
    view = t.view("b")
    assert view.ape_n == 1
    assert view.mape == pytest.approx(0.5)  # |p - 2p| / 2p
    feed(t, clock, "b", 300)
    assert t.view("b").mape is not None
    assert t.view("b").mape < 0.2  # type: ignore[operator]  # it learned


def test_what_produced_no_first_token_teaches_nothing() -> None:
    t, _clock = tracker()
    for outcome in (
        Outcome(ok=False, error="unreachable"),
        Outcome(ok=False, status=503, error="refused"),
        Outcome(ok=True, status=200, first_token_s=None, tokens=10, duration_s=1.0),
        Outcome(ok=True, status=200, first_token_s=float("nan")),
    ):
        t.observe("b", Load(), outcome)
    assert t.backends() == []
    assert t.view("b").observed == 0


def test_itl_is_learned_only_from_whole_streams() -> None:
    t, _clock = tracker()
    cut = Outcome(ok=False, error="stream", first_token_s=0.1, tokens=50, duration_s=9.0)
    for _ in range(50):
        t.observe("b", Load(running=2), cut)
    assert t.view("b").itl["base"] == pytest.approx(t.view("other").itl["base"])  # the prior's
    assert t.view("b").observed == 50  # its TTFT was learned


def test_backends_are_bounded() -> None:
    t, _clock = tracker(max_backends=3)
    for i in range(10):
        t.observe(f"b{i}", Load(), Outcome(ok=True, status=200, first_token_s=0.1))
    assert t.backends() == ["b7", "b8", "b9"]


def test_the_mean_answer_length_follows_recent_answers() -> None:
    t, _clock = tracker()
    for _ in range(400):
        t.observe(
            "b", Load(), Outcome(ok=True, status=200, first_token_s=0.1, tokens=40, duration_s=1.0)
        )
    assert t.mean_tokens == pytest.approx(40, rel=0.01)


def test_prompts_awaiting_their_first_token_are_ahead_of_newcomers_until_it_comes() -> None:
    t, _clock = tracker()
    a = t.begin("b", 1500)
    b = t.begin("b", 500)
    assert t.ahead("b") == 2000
    assert t.ahead("other") == 0
    a.done()
    a.done()  # idempotent: the first token, then the attempt's end
    assert t.ahead("b") == 500
    b.done()
    assert t.ahead("b") == 0
    assert t._pending == {}  # nothing left behind for a backend with nothing pending


def test_load_comes_from_the_scrape_when_fresh_else_from_the_gateways_own_count() -> None:
    scraped = BackendSnapshot("b", in_flight=5, sent_since_scrape=2, queue_depth=3, running=7)
    assert load_of(scraped, 800, cached=300) == Load(uncached=500, queued=5, running=7)
    local = BackendSnapshot("b", in_flight=5)
    assert load_of(local, 100, cached=400) == Load(uncached=0, queued=0, running=5)


def test_prompt_size_is_exact_with_token_ids_else_about_four_characters_a_token() -> None:
    assert prompt_size(RouteFacts("m", prompt_tokens=(1, 2, 3), prompt_chars=400)) == 3
    assert prompt_size(RouteFacts("m", prompt_chars=400)) == 100


def test_bad_configuration_is_refused() -> None:
    bad_ones = (
        {"half_life": 0},
        {"ridge": -1},
        {"resolve_s": -1},
        {"max_backends": 0},
        {"half_life": 10, "memory": 5},
    )
    for bad in bad_ones:
        with pytest.raises(ValueError, match="must be"):
            LatencyConfig(**bad)  # type: ignore[arg-type]


def test_a_backends_weight_is_its_observations_each_faded_by_its_age() -> None:
    t, clock = tracker(half_life=5.0)
    times = [0.0, 1.0, 2.5, 7.0, 7.0, 9.0]
    for at in times:
        clock.t = at
        t.observe("a", Load(), Outcome(ok=True, first_token_s=0.05, tokens=1, duration_s=0.05))
    for now in (9.0, 12.0, 30.0):
        faded = sum(0.5 ** ((now - at) / 5.0) for at in times)
        assert t.weight("a", now) == pytest.approx(faded, rel=1e-9)


def test_a_fit_whose_half_life_changes_ages_each_stretch_at_its_own() -> None:
    fit = DecayingFit(2)
    fit.add((1.0, 0.0), 1.0, now=0.0, half_life=2.0)
    fit.add((1.0, 0.0), 1.0, now=4.0, half_life=2.0)  # the first is a quarter by now
    fit.add((1.0, 0.0), 1.0, now=14.0, half_life=10.0)  # ten seconds more, at the new one
    assert fit.weight == pytest.approx((0.25 + 1.0) * 0.5 + 1.0, rel=1e-12)
    assert fit.at == 14.0


def test_a_fit_on_a_clock_far_from_zero_keeps_its_weights_finite() -> None:
    # time.monotonic() is the machine's uptime: 2 ** (uptime / half-life) overflows a float
    # after 85 minutes at a 5-s half-life, unless the sums' base time follows the clock.
    fit = DecayingFit(2)
    for i in range(300):
        fit.add((1.0, float(i % 4)), 0.1 + 0.01 * (i % 4), now=1e6 + i * 7.0, half_life=5.0)
    coef = fit.solve((0.05, 0.0), ridge=1e-6)
    assert coef == pytest.approx((0.1, 0.01), abs=1e-6)
    assert 0.0 < fit.weight < 2.0  # one at a time, seven seconds (1.4 half-lives) apart
