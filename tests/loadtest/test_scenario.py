"""Scenario files: the bundled ones parse; mistakes are named, not ignored."""

from __future__ import annotations

import pytest

from loadtest.arrivals import OpenLoop
from loadtest.scenario import (
    SCENARIO_DIR,
    ScenarioError,
    find_scenario,
    load_scenario,
    parse_scenario,
)

MINIMAL = """
[[backends]]
count = 2
args = ["--max-num-seqs", "4"]
[load]
mode = "closed"
concurrency = 2
requests = 5
"""


def test_every_bundled_scenario_parses() -> None:
    names = sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))
    assert {"backend-dies", "burst", "homogeneous", "shared-prefix", "slow-backend"} <= set(names)
    for name in names:
        sc = load_scenario(name)
        assert sc.name == name
        assert sc.description
        assert sc.policies


def test_slow_backend_has_one_of_three_backends_slowed_threefold() -> None:
    sc = load_scenario("slow-backend")
    assert len(sc.backends) == 3
    assert [("--slowdown" in b) for b in sc.backends] == [False, False, True]
    slow = sc.backends[2]
    assert slow[slow.index("--slowdown") + 1] == "3"
    assert isinstance(sc.load.arrivals, OpenLoop)
    assert sc.slo.ttft == pytest.approx(1.0)


def test_backend_dies_kills_one_backend_mid_run() -> None:
    sc = load_scenario("backend-dies")
    (event,) = sc.events
    assert event.action == "kill"
    assert sc.load.warmup < event.at < sc.load.warmup + (sc.load.duration or 0)


def test_burst_and_shared_prefix_shapes() -> None:
    burst = load_scenario("burst").load.arrivals
    assert isinstance(burst, OpenLoop)
    assert burst.burstiness < 1
    prefix = load_scenario("shared-prefix").workload.prefix
    assert prefix.groups > 1
    assert prefix.hot_share is not None


def test_minimal_scenario_defaults() -> None:
    sc = parse_scenario(MINIMAL, source="x/mini.toml")
    assert sc.name == "mini"
    assert sc.replicas == 1
    assert load_scenario("prefix-affinity-replicas").replicas == 2
    assert sc.backends == (("--max-num-seqs", "4"),) * 2
    assert sc.load.requests == 5
    assert sc.events == ()
    assert sc.slo.empty


def test_lengths_and_faults_events_parse() -> None:
    sc = parse_scenario(
        MINIMAL
        + """
[workload]
prompt = 12
output = { kind = "uniform", low = 2, high = 9 }
[[events]]
at = 2.5
backend = 1
faults = { slowdown = 3.0 }
"""
    )
    assert sc.workload.prompt.value == 12
    assert (sc.workload.output.low, sc.workload.output.high) == (2, 9)
    assert sc.events[0].action == "faults"
    assert sc.events[0].faults == {"slowdown": 3.0}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("colour = 'red'\n", "unknown key"),
        ("[workload]\nprompt = { kind = 'lognormal', mu = 3 }\n", "unknown key"),
        ("[[events]]\nat = 1\nbackend = 5\naction = 'kill'\n", "no backend 5"),
        ("[[events]]\nat = 1\nbackend = 0\n", "needs a faults table"),
        ("[workload]\nendpoint = 'embeddings'\n", "endpoint"),
        ("[slo]\nttft = 5\n", "unknown key"),
        ("[gateway]\nreplicas = 0\n", "replicas"),
        ("[gateway]\nreplicas = 1.5\n", "replicas"),
    ],
)
def test_mistakes_are_named(extra: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(extra + MINIMAL if extra.startswith("colour") else MINIMAL + extra)


def test_policies_and_load_mode_are_checked() -> None:
    with pytest.raises(ScenarioError, match="unknown policy"):
        parse_scenario('policies = ["fastest"]\n' + MINIMAL)
    with pytest.raises(ScenarioError, match="needs 'rate'"):
        parse_scenario(MINIMAL.replace('mode = "closed"', 'mode = "open"'))
    with pytest.raises(ScenarioError, match="at least one"):
        parse_scenario("[load]\nmode='closed'\nconcurrency=1\nrequests=1\n")


def test_unknown_scenario_name_lists_the_bundled_ones() -> None:
    with pytest.raises(ScenarioError, match="slow-backend"):
        find_scenario("no-such-scenario")
