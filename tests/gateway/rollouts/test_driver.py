"""The driver's turn, with what it reads and writes stood in for: it keeps its lease through a
long turn (the probes), holds off while another replica holds it, and sends nothing twice."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from backends.errors import Conflict
from gateway.fleet.figures import Figures, PoolCounts
from gateway.rollouts.driver import Driver
from gateway.rollouts.gates import Gates
from gateway.rollouts.plan import Plan
from gateway.rollouts.state import RolloutBook, Rollouts

PLAN = Plan(
    "chat",
    "v1",
    "v2",
    steps=(50.0, 100.0),
    hold_s=0.0,
    min_requests=2,
    gates=Gates(min_agreement=0.9),
    probes=("hi",),
)


def figures(canary: int) -> Figures:
    counts = {"v1": PoolCounts(100), "v2": PoolCounts(canary)}
    return Figures(pools={"chat": counts})


class Claim:
    """A lease that is ours (or not), counting each acquire (a take, or a renewal)."""

    def __init__(self, ours: bool = True) -> None:
        self.ours = ours
        self.acquired = 0
        self.renewed = asyncio.Event()

    async def acquire(self) -> int | None:
        self.acquired += 1
        if self.acquired > 1:
            self.renewed.set()
        return 1 if self.ours else None

    async def release(self) -> bool:
        return True


async def test_the_lease_is_renewed_while_a_turn_waits_on_its_probes() -> None:
    claim = Claim()
    sent: list[dict[str, Any]] = []
    base = {"self": {"v1": PoolCounts(100), "v2": PoolCounts(0)}}
    book = RolloutBook(Rollouts().start(PLAN, 0.0).window("chat", 0, token=1, baseline=base))

    async def probe(_plan: Plan) -> float:
        await claim.renewed.wait()  # answered only once the lease was renewed meanwhile
        return 1.0

    async def submit(_alias: str, body: dict[str, Any]) -> None:
        sent.append(body)

    async def read() -> dict[str, Figures]:
        return {"self": figures(canary=5)}

    driver = Driver(book, read, submit, lambda _a: claim, every=0.001, probe=probe)
    await asyncio.wait_for(driver.turn(), 10)
    assert [b["action"] for b in sent] == ["advance"]
    assert [r["canary"] for r in sent[0]["readings"] if r["gate"] == "probes"] == [1.0]
    assert claim.acquired >= 2


async def test_a_rollout_another_replica_drives_is_left_alone() -> None:
    claim = Claim(ours=False)
    sent: list[dict[str, Any]] = []
    book = RolloutBook(Rollouts().start(PLAN, 0.0))

    async def submit(_alias: str, body: dict[str, Any]) -> None:
        sent.append(body)

    async def read() -> dict[str, Figures]:
        raise AssertionError("not read: another replica drives it")

    driver = Driver(book, read, submit, lambda _a: claim, every=0.001)
    await driver.turn()
    assert sent == []
    assert driver.progress == {}


async def test_a_configured_plan_is_started_by_the_lease_holder_once() -> None:
    book = RolloutBook()
    started: list[Plan] = []

    async def start(plan: Plan) -> None:  # as the log applies it here
        started.append(plan)
        book.now = book.now.start(plan, 0.0, "configuration", configured=True)

    async def submit(_alias: str, _body: dict[str, Any]) -> None:
        return None

    async def read() -> dict[str, Figures]:
        return {"self": figures(canary=0)}

    # Another replica holds the alias's lease: it starts the plan, not this one.
    elsewhere = Driver(
        book, read, submit, lambda _a: Claim(ours=False), every=0.001,
        configured=lambda: (PLAN,), start=start,
    )  # fmt: skip
    await elsewhere.turn()
    assert started == []
    here = Driver(
        book, read, submit, lambda _a: Claim(), every=0.001, configured=lambda: (PLAN,), start=start
    )
    for _ in range(3):
        await here.turn()
    assert started == [PLAN]
    run = book.now.get("chat")
    assert run is not None
    assert run.history[0].by == "configuration"
    book.now = book.now.abort("chat", 1.0, "aborted by an operator")
    await here.turn()
    assert started == [PLAN]  # ended, and not started again


async def test_a_configured_plan_that_cannot_start_is_said_once() -> None:
    book = RolloutBook()
    tries: list[Plan] = []

    async def start(plan: Plan) -> None:
        tries.append(plan)
        raise Conflict("unknown pool(s): v2")

    async def read() -> dict[str, Figures]:
        return {}

    async def submit(_alias: str, _body: dict[str, Any]) -> None:
        return None

    driver = Driver(
        book, read, submit, lambda _a: Claim(), every=0.001, configured=lambda: (PLAN,), start=start
    )
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            await driver.turn()
    assert len(tries) == 3  # tried each turn (a reload may mend it)
    refused = [e for e in logs if e["event"] == "rollout_configured_refused"]
    assert [(e["alias"], e["why"]) for e in refused] == [("chat", "unknown pool(s): v2")]
