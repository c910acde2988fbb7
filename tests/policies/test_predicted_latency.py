"""predicted_latency's decisions on hand-built snapshots and a tracker taught by hand."""

from __future__ import annotations

import random

import pytest

from policies import (
    AffinityConfig,
    BackendSnapshot,
    KvIndex,
    LatencyTracker,
    Outcome,
    PredictedLatency,
    PredictionConfig,
    PrefixAffinity,
    RouteFacts,
    make_policy,
)
from policies.latency import Load
from policies.predicted_latency import rescue_declined
from policies.prefix import PrefixHasher

HASHER = PrefixHasher(block_chars=64, max_blocks=128)


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def teach(
    t: LatencyTracker,
    backend: str,
    *,
    base: float,
    per_queued: float = 0.0,
    per_ktok: float = 0.0,
    itl: float = 0.01,
    n: int = 200,
) -> None:
    """``backend`` answers in ``base`` + ``per_queued`` x queue + ``per_ktok`` x uncached/1000,
    then ``itl`` a token."""
    rng = random.Random(backend)
    for _ in range(n):
        load = Load(rng.uniform(0, 4000), rng.randrange(0, 8), rng.randrange(0, 8))
        ttft = base + per_queued * load.queued + per_ktok * load.uncached / 1000
        outcome = Outcome(
            ok=True, status=200, first_token_s=ttft, tokens=101, duration_s=ttft + 100 * itl
        )
        t.observe(backend, load, outcome)


def snap(id_: str, in_flight: int = 0, queue: int | None = 0, running: int = 0) -> BackendSnapshot:
    return BackendSnapshot(id_, in_flight=in_flight, queue_depth=queue, running=running)


def facts(chars: int = 400, max_tokens: int | None = None, **kw: object) -> RouteFacts:
    return RouteFacts("m", prompt_chars=chars, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def policy(
    tracker: LatencyTracker,
    *,
    prefix: str = "none",
    objective: str = "ttft",
    balance_abs: float = 6.0,
    balance_rel: float = 1.5,
) -> PredictedLatency:
    p = make_policy(
        "predicted_latency",
        rng=random.Random(0),
        tracker=tracker,
        prediction=PredictionConfig(
            objective=objective,  # type: ignore[arg-type]
            prefix=prefix,  # type: ignore[arg-type]
            balance_abs=balance_abs,
            balance_rel=balance_rel,
        ),
    )
    assert isinstance(p, PredictedLatency)
    return p


@pytest.fixture
def mixed() -> LatencyTracker:
    """Two backends: ``fast`` (50 ms + 100 ms per queued request) and ``slow`` three times
    slower on both."""
    t = LatencyTracker(clock=Clock())
    teach(t, "fast", base=0.05, per_queued=0.1)
    teach(t, "slow", base=0.15, per_queued=0.3)
    return t


def test_of_equally_loaded_backends_the_faster_is_chosen(mixed: LatencyTracker) -> None:
    p = policy(mixed)
    for _ in range(20):
        choice = p.choose(facts(), [snap("slow", queue=1), snap("fast", queue=1)])
        assert choice is not None
        assert choice.backend.id == "fast"


def test_the_slow_backend_gets_the_request_once_the_fast_one_is_queued_enough(
    mixed: LatencyTracker,
) -> None:
    p = policy(mixed, balance_abs=100)
    # fast: 0.05 + 0.1 x 3 = 0.35 s; slow: 0.15 + 0.3 x 0 = 0.15 s
    choice = p.choose(facts(), [snap("fast", queue=3), snap("slow", queue=0)])
    assert choice is not None
    assert choice.backend.id == "slow"
    # fast: 0.05 + 0.1 = 0.15 s against slow's 0.15 + 0.3 = 0.45 s
    choice = p.choose(facts(), [snap("fast", queue=1), snap("slow", queue=1)])
    assert choice is not None
    assert choice.backend.id == "fast"


def test_an_overloaded_backend_is_never_chosen_however_fast_it_is_predicted(
    mixed: LatencyTracker,
) -> None:
    p = policy(mixed, balance_abs=4, balance_rel=1.5)
    # least_load scores: fast 2 x 5 + 3 x 0 = 10, slow 2 x 1 = 2; one more request on fast
    # puts it 10 above slow (more than 4) and 6 times over: guarded.
    choice = p.choose(facts(), [snap("fast", in_flight=5), snap("slow", in_flight=1)])
    assert choice is not None
    assert choice.backend.id == "slow"
    assert p.decisions["guarded"] == 1


def test_e2e_weighs_the_answer_ttft_only_the_first_token() -> None:
    t = LatencyTracker(clock=Clock())
    teach(t, "quick_start", base=0.05, itl=0.05)  # first token soon, then slow
    teach(t, "quick_stream", base=0.4, itl=0.01)  # first token late, then fast
    cands = [snap("quick_start"), snap("quick_stream")]
    ttft = policy(t, objective="ttft").choose(facts(max_tokens=200), cands)
    e2e = policy(t, objective="e2e").choose(facts(max_tokens=200), cands)
    assert ttft is not None
    assert ttft.backend.id == "quick_start"
    assert e2e is not None
    assert e2e.backend.id == "quick_stream"
    # A short answer is over sooner where it starts sooner.
    short = policy(t, objective="e2e").choose(facts(max_tokens=2), cands)
    assert short is not None
    assert short.backend.id == "quick_start"


def test_the_requests_own_objective_overrides_the_policys() -> None:
    t = LatencyTracker(clock=Clock())
    teach(t, "quick_start", base=0.05, itl=0.05)
    teach(t, "quick_stream", base=0.4, itl=0.01)
    cands = [snap("quick_start"), snap("quick_stream")]
    p = policy(t, objective="ttft")
    batch = p.choose(facts(max_tokens=200, objective="e2e"), cands)
    assert batch is not None
    assert batch.backend.id == "quick_stream"
    assert p.decisions["e2e"] == 1


def test_a_backend_holding_the_prompts_prefix_is_predicted_faster_where_prefill_costs() -> None:
    t = LatencyTracker(clock=Clock())
    teach(t, "a", base=0.05, per_ktok=0.5)
    teach(t, "b", base=0.05, per_ktok=0.5)
    p = policy(t, prefix="approximate", balance_abs=100)
    text = "x" * 64 * 64  # 4,096 characters: 64 blocks, about 1,000 tokens
    hashes, _ = HASHER.facts("m", {"prompt": text})
    f = facts(chars=len(text), prefix_hashes=hashes)
    first = p.choose(f, [snap("a"), snap("b", queue=0)])
    assert first is not None
    assert first.cached_tokens == 0  # nobody held it yet
    p.on_result(f, first, Outcome(ok=True, status=200))
    held = first.backend.id
    other = "b" if held == "a" else "a"
    # The same prompt again: the backend that has it is chosen even a little more loaded.
    again = facts(chars=len(text), prefix_hashes=hashes)
    choice = p.choose(again, [snap(held, running=2), snap(other, running=0)])
    assert choice is not None
    assert choice.backend.id == held
    assert choice.cached_tokens == pytest.approx(1024)  # what it was chosen for, said with it


def test_the_cached_tokens_a_decision_carries_are_those_its_choice_was_predicted_with() -> None:
    """With prefix knowledge, the decision's ``cached_tokens`` is the chosen backend's share
    of the prompt the policy weighed: its prediction for that backend is the one made with
    them (checked by making the prediction decide between two otherwise equal backends)."""
    t = LatencyTracker(clock=Clock())
    teach(t, "a", base=0.05, per_ktok=0.5)
    teach(t, "b", base=0.05, per_ktok=0.5, per_queued=0.1)
    p = policy(t, prefix="approximate", balance_abs=100)
    assert isinstance(p.prefix, PrefixAffinity)
    text = "x" * 64 * 64  # about 1,000 tokens
    hashes, _ = HASHER.facts("m", {"prompt": text})
    f = facts(chars=len(text), prefix_hashes=hashes)
    p.prefix.index.record("b", hashes[:32])  # b holds half the prompt, a none of it
    decision = p.choose(f, [snap("a"), snap("b", queue=1)])
    assert decision is not None
    # b: 0.05 + 0.1 (queued) + 0.5 x 0.5 (half uncached) = 0.4 s, 0.65 s were it uncached;
    # a: 0.05 + 0.5 = 0.55 s.
    assert decision.backend.id == "b"
    assert decision.cached_tokens == pytest.approx(512)
    size = len(text) / 4
    with_cache = t.predict("b", t.load(decision.backend, size, decision.cached_tokens))
    assert with_cache.ttft < t.predict("a", t.load(snap("a"), size)).ttft
    assert t.predict("b", t.load(decision.backend, size)).ttft > with_cache.ttft


@pytest.mark.parametrize("prefix", ["approximate", "precise"])
def test_its_prefix_knowledge_settles_the_record_its_decision_carries(prefix: str) -> None:
    """The choice is recorded as its prefix policy would record it; a failed attempt's
    decision hands that record back to it, which withdraws it."""
    p = make_policy(
        "predicted_latency",
        tracker=LatencyTracker(clock=Clock()),
        kv_index=KvIndex(),
        prediction=PredictionConfig(prefix=prefix),  # type: ignore[arg-type]
    )
    assert isinstance(p, PredictedLatency)
    source = p.prefix
    assert source is not None
    hashes = (11, 12, 13)
    f = facts(prefix_hashes=hashes)
    decision = p.choose(f, [snap("a"), snap("b")])
    assert decision is not None
    chosen = decision.backend.id
    index = source.approximate.index
    assert index.match(hashes, [chosen]) == {chosen: 3}
    p.on_result(f, decision, Outcome(ok=False, error="unreachable"))
    assert index.match(hashes, [chosen]) == {chosen: 0}


def test_without_prefix_knowledge_the_policy_asks_only_for_the_prompts_size() -> None:
    t = LatencyTracker(clock=Clock())
    none = policy(t)
    assert none.needs.size
    assert none.needs.prefix is None
    assert not none.needs.tokens
    approx = policy(t, prefix="approximate")
    assert approx.needs.size
    assert approx.needs.prefix == AffinityConfig().hasher


def test_switching_to_it_and_back_keeps_what_prefix_affinity_learned() -> None:
    t = LatencyTracker(clock=Clock())
    pa = make_policy("prefix_affinity")
    assert isinstance(pa, PrefixAffinity)
    pa.index.record("a", (1, 2, 3))
    pl = make_policy(
        "predicted_latency",
        previous=pa,
        tracker=t,
        prediction=PredictionConfig(prefix="approximate"),
    )
    assert isinstance(pl, PredictedLatency)
    assert isinstance(pl.prefix, PrefixAffinity)
    assert pl.prefix.index is pa.index
    back = make_policy("prefix_affinity", previous=pl)
    assert isinstance(back, PrefixAffinity)
    assert back.index is pa.index


def test_ties_are_broken_at_random_not_by_order() -> None:
    t = LatencyTracker(clock=Clock())
    p = policy(t)
    chosen = {p.choose(facts(), [snap("a"), snap("b"), snap("c")]).backend.id for _ in range(60)}  # type: ignore[union-attr]
    assert chosen == {"a", "b", "c"}


def test_nothing_to_choose_from_is_no_choice() -> None:
    assert policy(LatencyTracker(clock=Clock())).choose(facts(), []) is None


def test_it_needs_the_tracker_and_a_known_objective() -> None:
    with pytest.raises(ValueError, match="tracker"):
        make_policy("predicted_latency")
    with pytest.raises(ValueError, match="objective"):
        PredictionConfig(objective="fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix"):
        PredictionConfig(prefix="psychic")  # type: ignore[arg-type]


def test_a_backend_not_chosen_lately_is_tried_again_one_known_much_slower_is_not() -> None:
    clock = Clock()
    t = LatencyTracker(clock=clock)
    teach(t, "busy", base=0.1, n=200)
    teach(t, "rested", base=0.15, n=200)  # a little slower, a minute ago
    clock.t += 60.0  # since then only "busy" was chosen
    teach(t, "busy", base=0.1, n=200)
    cands = [snap("busy"), snap("rested")]
    assert t.predict("rested", Load()).ttft > t.predict("busy", Load()).ttft
    explorer = policy(t)
    choice = explorer.choose(facts(), cands)
    assert choice is not None
    assert choice.backend.id == "rested"  # what is known of it is a minute old: tried again
    certain = make_policy(
        "predicted_latency", tracker=t, prediction=PredictionConfig(prefix="none", explore=0.0)
    )
    choice = certain.choose(facts(), cands)
    assert choice is not None
    assert choice.backend.id == "busy"
    teach(t, "slug", base=0.6, n=200)  # four times slower, a minute ago
    clock.t += 60.0
    teach(t, "busy", base=0.1, n=200)
    choice = explorer.choose(facts(), [snap("busy"), snap("slug")])
    assert choice is not None
    assert choice.backend.id == "busy"  # optimism does not make a known slow backend look fast


def test_the_rescue_deadline_is_a_multiple_of_the_prediction_for_a_backend_it_knows() -> None:
    clock = Clock()
    tracker = LatencyTracker(clock=clock)
    teach(tracker, "known", base=0.2)
    policy = PredictedLatency(tracker, prediction=PredictionConfig(rescue_factor=3, rescue_min=0.1))
    assert policy.first_token_deadline("known", 0.2) == pytest.approx(0.6)
    assert policy.first_token_deadline("known", 0.01) == 0.1  # never before rescue_min
    # A backend with no recent observations: its prediction is the fleet's, no promise.
    assert policy.first_token_deadline("new", 0.2) is None
    clock.t = 120.0  # two minutes later its observations have faded too
    assert policy.first_token_deadline("known", 0.2) is None
    off = PredictedLatency(tracker, prediction=PredictionConfig(rescue_factor=0))
    teach(tracker, "known", base=0.2)
    assert off.first_token_deadline("known", 0.2) is None
    assert policy.first_token_deadline("known", float("inf")) is None


def test_a_late_stream_moves_only_to_a_backend_with_no_queue() -> None:
    def other(queue: int | None) -> BackendSnapshot:
        return BackendSnapshot(id=f"q{queue}", in_flight=3, queue_depth=queue, running=3)

    assert rescue_declined([]) == "no_other_backend"
    # Every other engine has requests waiting: the fleet is behind, not the late one's backend.
    assert rescue_declined([other(2), other(1)]) == "others_queued"
    assert rescue_declined([other(2), other(0)]) is None  # one would take it at once
    assert rescue_declined([other(None)]) is None  # not scraped lately: may well take it


@pytest.mark.parametrize(
    "bad", [{"rescue_factor": 0.5}, {"rescue_factor": -1}, {"rescue_min": -0.1}]
)
def test_a_rescue_that_could_fire_before_its_prediction_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="rescue"):
        PredictionConfig(**bad)  # type: ignore[arg-type]
