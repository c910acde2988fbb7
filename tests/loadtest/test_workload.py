"""The workload generator: reproducible, and the lengths, prefixes and sessions asked for."""

from __future__ import annotations

import random
import statistics

import pytest

from loadtest.workload import CHAT_OUTPUT, CHAT_PROMPT, LengthDist, PrefixGroups, Workload


def user_words(body: dict[str, object]) -> int:
    messages = body["messages"]
    assert isinstance(messages, list)
    return len(messages[-1]["content"].split())


def test_same_seed_same_requests_and_another_seed_others() -> None:
    w = Workload(prompt=CHAT_PROMPT, output=CHAT_OUTPUT, seed=7)
    assert w.take(30) == Workload(prompt=CHAT_PROMPT, output=CHAT_OUTPUT, seed=7).take(30)
    assert w.take(30) != Workload(prompt=CHAT_PROMPT, output=CHAT_OUTPUT, seed=8).take(30)


def test_fixed_lengths_are_exact() -> None:
    for spec in Workload(prompt=LengthDist.fixed(50), output=LengthDist.fixed(9)).take(10):
        assert user_words(spec.body) == 50
        assert spec.max_tokens == 9
        assert spec.body["max_tokens"] == 9
        assert spec.body["ignore_eos"] is True
        assert spec.body["stream_options"] == {"include_usage": True}


def test_uniform_lengths_stay_within_bounds_and_cover_them() -> None:
    d = LengthDist.uniform(3, 6)
    rng = random.Random(1)
    seen = {d.sample(rng) for _ in range(500)}
    assert seen == {3, 4, 5, 6}


def test_lognormal_mean_matches_its_parameters() -> None:
    d = LengthDist.lognormal(median=100, sigma=0.8, low=1, high=10**9)
    rng = random.Random(2)
    samples = [d.sample(rng) for _ in range(20_000)]
    assert statistics.fmean(samples) == pytest.approx(d.mean, rel=0.05)
    assert statistics.median(samples) == pytest.approx(100, rel=0.05)


def test_chat_presets_have_the_documented_means() -> None:
    assert CHAT_PROMPT.mean == pytest.approx(161, rel=0.01)
    assert CHAT_OUTPUT.mean == pytest.approx(338, rel=0.01)


def test_lognormal_is_clipped() -> None:
    d = LengthDist.lognormal(median=100, sigma=3.0, low=10, high=200)
    rng = random.Random(3)
    assert all(10 <= d.sample(rng) <= 200 for _ in range(2000))


def test_shared_prefix_groups_with_a_hot_group() -> None:
    w = Workload(prefix=PrefixGroups(groups=5, length=40, hot_share=0.7), seed=1)
    specs = w.take(3000)
    share = sum(1 for s in specs if s.group == 0) / len(specs)
    assert share == pytest.approx(0.7, abs=0.03)
    assert {s.group for s in specs} == {0, 1, 2, 3, 4}
    systems: dict[int | None, set[str]] = {}
    for s in specs:
        system = s.body["messages"][0]
        assert system["role"] == "system"
        assert len(system["content"].split()) == 40
        systems.setdefault(s.group, set()).add(system["content"])
    assert all(len(v) == 1 for v in systems.values())  # one prefix per group
    assert len({next(iter(v)) for v in systems.values()}) == 5  # distinct across groups


def test_the_hot_group_can_have_a_prefix_length_of_its_own() -> None:
    w = Workload(prefix=PrefixGroups(groups=3, length=40, hot_share=0.5, hot_length=8), seed=2)
    lengths = {s.group: len(s.body["messages"][0]["content"].split()) for s in w.take(200)}
    assert lengths == {0: 8, 1: 40, 2: 40}


def test_multi_turn_sessions_extend_the_previous_prompt() -> None:
    w = Workload(turns=3, interleave=4, prompt=LengthDist.fixed(5), output=LengthDist.fixed(7))
    specs = w.take(24)
    by_index = {s.index: s for s in specs}
    for s in specs:
        if s.turn == 0:
            assert s.after is None
            continue
        prev = by_index[s.after] if s.after is not None else None
        assert prev is not None
        assert (prev.session, prev.turn) == (s.session, s.turn - 1)
        assert prev.index < s.index
        msgs, prev_msgs = s.body["messages"], prev.body["messages"]
        assert msgs[: len(prev_msgs)] == prev_msgs
        assert msgs[len(prev_msgs)]["role"] == "assistant"
        assert len(msgs[len(prev_msgs)]["content"].split()) == 7
        assert s.prompt_tokens == prev.prompt_tokens + 7 + 5
    assert {s.turn for s in specs} == {0, 1, 2}


def test_completions_endpoint_and_no_streaming() -> None:
    spec = Workload(
        endpoint="completions",
        stream=False,
        prefix=PrefixGroups(groups=1, length=4),
        prompt=LengthDist.fixed(3),
    ).take(1)[0]
    assert spec.path == "/v1/completions"
    assert "messages" not in spec.body
    assert len(spec.body["prompt"].split()) == 4 + 3
    assert "stream" not in spec.body
    assert "stream_options" not in spec.body


@pytest.mark.parametrize(
    "make",
    [
        lambda: LengthDist.fixed(0),
        lambda: LengthDist.uniform(5, 2),
        lambda: LengthDist.lognormal(0, 1),
        lambda: PrefixGroups(groups=2, length=3, hot_share=1.5),
        lambda: Workload(turns=0),
    ],
)
def test_bad_parameters_are_rejected(make: object) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case has its own message
        make()  # type: ignore[operator]
