"""``llm-gateway top`` with capacity: each engine's state in the backends' table, and a line with
the engines in each state, who manages and the engine-seconds asleep it counted; on fixed
inputs, and against a gateway whose idle simulators (vLLM's dev mode) are put to sleep."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

from rich.console import Console

from tests.helpers import gateway_for, wait_for
from tools.sim import FAST, RunningSim
from tools.top import MetricsSample, TopClient, capacity_line, engine_states, frame, render

TOKEN = "top-capacity-secret"
MODEL = "sim-model"
ALONE: dict[str, Any] = {"fleet": None, "replicas": []}


def shown(renderable: object) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(renderable)
    return out.getvalue()


def capacity(
    states: dict[str, str], enabled: bool = True, managing: bool = True, asleep_s: float = 0.0
) -> dict[str, Any]:
    """``GET /admin/capacity`` as a gateway answers it, its manager's turn trimmed."""
    counts = {s: list(states.values()).count(s) for s in ("awake", "going_to_sleep")}
    counts |= {s: list(states.values()).count(s) for s in ("asleep", "waking")}
    look = {"token": 3, "models": {}, "steps": [], "asleep_seconds": asleep_s}
    return {
        "enabled": enabled,
        "rules": {},
        "token": 3,
        "engines": [{"backend": b, "state": s} for b, s in states.items()],
        "states": counts,
        "managing": managing,
        "look": look if managing else {},
    }


def backends(*ids: str) -> dict[str, Any]:
    row = {"health": "up", "circuit": "closed", "draining": False, "in_flight": 0}
    return {"policy": "least_load", "backends": [{**row, "id": i} for i in ids]}


def test_each_engines_state_is_a_column_of_the_backends_table() -> None:
    doc = capacity({"a": "awake", "b": "going_to_sleep", "c": "asleep", "d": "waking"})
    rows = frame(backends("a", "b", "c", "d"), MetricsSample(1.0), None, engine_states(doc))
    assert [r.state for r in rows] == ["awake", "going_to_sleep", "asleep", "waking"]
    text = shown(render(rows, "least_load"))
    assert " state " in text.splitlines()[2]  # the header
    for backend, state in (("a", "awake"), ("b", "going to sleep"), ("c", "asleep")):
        (line,) = [ln for ln in text.splitlines() if f"│ {backend} " in ln]
        assert f" {state} " in line


def test_without_capacity_the_table_has_no_state_column() -> None:
    """Off with every engine awake, or a gateway of before capacity (no /admin/capacity)."""
    for doc in (capacity({"a": "awake"}, enabled=False, managing=False), None):
        assert engine_states(doc) is None
        assert capacity_line(doc, ALONE) is None
        rows = frame(backends("a"), MetricsSample(1.0), None, engine_states(doc))
        assert " state " not in shown(render(rows, "least_load"))


def test_the_line_says_the_states_the_manager_and_the_engine_seconds_asleep() -> None:
    doc = capacity({"a": "awake", "b": "asleep", "c": "asleep"}, asleep_s=4321.4)
    line = capacity_line(doc, ALONE)
    assert line is not None
    assert line.plain == (
        "capacity: awake 1 · going to sleep 0 · asleep 2 · waking 0 · managed by this gateway "
        "· 4,321 engine-s asleep since it started"
    )


def test_in_a_fleet_the_line_names_the_managing_replica_and_what_its_count_covers() -> None:
    """The replica asked does not manage: the manager's turn from its report (the newer lease's
    of two during a hand-over), its count said to be its own, not the fleet's."""
    doc = capacity({"a": "awake", "b": "asleep"}, managing=False)
    look = {"models": {}, "steps": [], "asleep_seconds": 90.0}
    replicas = {
        "fleet": "prod",
        "self": "r0",
        "replicas": [
            {"id": "r0", "capacity": {}},
            {"id": "r1", "capacity": {**look, "token": 7}},
            {"id": "r2", "capacity": {**look, "token": 6, "asleep_seconds": 5.0}},
        ],
    }
    line = capacity_line(doc, replicas)
    assert line is not None
    assert "managed by r1 · 90 engine-s asleep counted by it while it managed" in line.plain
    assert "llm_gateway_capacity_asleep_seconds_total summed over the replicas" in line.plain
    mine = capacity_line({**capacity({"a": "asleep"}, asleep_s=12.0)}, replicas)
    assert mine is not None
    assert "managed by r0 (this one) · 12 engine-s" in mine.plain
    nobody = capacity_line(doc, {**replicas, "replicas": [{"id": "r0", "capacity": {}}]})
    assert nobody is not None
    assert nobody.plain.endswith("· no replica manages yet")


def test_an_engine_slept_by_hand_with_the_manager_off_is_still_shown() -> None:
    doc = capacity({"a": "awake", "b": "going_to_sleep"}, enabled=False, managing=False)
    assert engine_states(doc) == {"a": "awake", "b": "going_to_sleep"}
    line = capacity_line(doc, ALONE)
    assert line is not None
    assert line.plain.startswith("capacity (manager OFF): awake 1 · going to sleep 1")


async def test_top_shows_idle_engines_asleep_on_a_live_gateway() -> None:
    config = dataclasses.replace(FAST, dev_mode=True, wake_time=0.3)
    engines = [RunningSim(config) for _ in range(3)]
    rule = {"min_awake": 1, "idle_before_sleep": 0.1}
    settings = {"enabled": True, "every": 0.05, "sleep_poll": 0.05, "models": {MODEL: rule}}
    names = ["gpu-a", "gpu-b", "gpu-c"]
    async with gateway_for(*engines, names=names, capacity=settings, admin={"token": TOKEN}) as (
        gw,
        s,
    ):
        assert gw.admin_url is not None

        def two_asleep() -> bool:
            return sorted(b.rest.value for b in gw.svc.pool.all()) == ["asleep", "asleep", "awake"]

        await wait_for(two_asleep, within=30, what="two of three engines asleep")
        text = shown(await TopClient(s, gw.admin_url, TOKEN).next_frame())
        states = [
            state
            for line in text.splitlines()
            for state in ("awake", "asleep")
            if any(f"│ {n} " in line for n in names) and f" {state} " in line
        ]
        assert sorted(states) == ["asleep", "asleep", "awake"]
        assert "capacity: awake 1 · going to sleep 0 · asleep 2 · waking 0" in text
        assert "managed by this gateway" in text
        assert "engine-s asleep since it started" in text
