"""An attempt carries its policy's ``Decision``: the cached tokens the decision says are what the
attempt's latency is predicted and learned against (``gateway.request.call.expected``)."""

from __future__ import annotations

import pytest

from backends.pool import BackendPool
from backends.state import BackendSpec
from gateway.request.call import expected
from gateway.request.router import Router
from policies import (
    BackendSnapshot,
    LatencyTracker,
    Outcome,
    PredictionConfig,
    make_policy,
)
from policies.latency import prompt_size

DOC = {"model": "m", "prompt": "x" * 4096}  # 64 blocks of 64 characters, about 1,000 tokens


def test_an_attempt_is_predicted_with_the_cached_tokens_its_decision_carries() -> None:
    tracker = LatencyTracker(clock=lambda: 0.0)
    prediction = PredictionConfig(prefix="approximate")
    policy = make_policy("predicted_latency", tracker=tracker, prediction=prediction)
    pool = BackendPool([BackendSpec("a", "http://a")], stale_after=1.0)
    router = Router(pool, policy, prefill=policy, decode=policy)
    cands = [BackendSnapshot("a", in_flight=0)]

    first = router.route("m", DOC, {}).serve
    cold = policy.choose(first.facts, cands)
    assert cold is not None
    assert cold.cached_tokens == 0
    size = prompt_size(first.facts)
    exp = expected(tracker, first, cold)
    assert exp.load.uncached == pytest.approx(size)
    exp.pending.done()
    policy.on_result(first.facts, cold, Outcome(ok=True, status=200))

    step = router.route("m", DOC, {}).serve  # the same prompt again, another request
    warm = policy.choose(step.facts, cands)
    assert warm is not None
    assert 0 < warm.cached_tokens <= size
    exp = expected(tracker, step, warm)
    assert exp.load.uncached == pytest.approx(size - warm.cached_tokens)
    assert exp.predicted == tracker.predict("a", exp.load)
    exp.pending.done()
