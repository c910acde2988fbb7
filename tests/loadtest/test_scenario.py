"""Scenario files: the bundled ones parse; mistakes are named, not ignored."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from loadtest import procs
from loadtest.arrivals import OpenLoop
from loadtest.client import RunResult
from loadtest.scenario import (
    SCENARIO_DIR,
    Event,
    ScenarioError,
    _Events,
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


def test_drain_and_undrain_events_parse_and_take_no_faults() -> None:
    base = MINIMAL + "[[events]]\nat = 1\nbackend = 1\n"
    sc = parse_scenario(base + "action = 'drain'\n")
    assert sc.events[0].action == "drain"
    assert parse_scenario(base + "action = 'undrain'\n").events[0].action == "undrain"
    for action in ("drain", "undrain", "kill"):
        with pytest.raises(ScenarioError, match=f"a {action} event takes no faults table"):
            parse_scenario(base + f"action = '{action}'\nfaults = {{ slowdown = 2 }}\n")
    with pytest.raises(ScenarioError, match="action must be one of kill, faults, drain, undrain"):
        parse_scenario(base + "action = 'pause'\n")


async def test_a_failing_event_voids_the_run() -> None:
    """A drain whose admin call fails (nothing listens there) stops the load and raises: the
    run does not go on as if the backend had been drained."""
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        nobody = f"http://127.0.0.1:{procs.free_port()}"
        events = _Events(session, [], [nobody], "token", [["b0", "b1"]], loop.create_future())
        load_cancelled = asyncio.Event()

        async def load() -> RunResult:
            await events.action(Event(at=0.0, backend=1, action="drain"))()
            try:
                await asyncio.Event().wait()  # a load that would not end by itself
            finally:
                load_cancelled.set()
            raise AssertionError("unreachable")

        with pytest.raises(RuntimeError, match=r"event at 0.0 s \(drain backend 1\) failed"):
            await events.until_failed(load())
    assert load_cancelled.is_set()
