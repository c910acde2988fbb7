"""Issue 55's "done when": three replicas on Redis in front of three simulators in vLLM's dev
mode, the capacity manager on. One replica manages at a time (each replica's ``GET
/admin/capacity`` sampled all along); idle engines go to sleep down to ``min_awake``, as the
simulators themselves and every replica see it; the managing replica is killed mid-way (right
after its first sleep decision, or while its first ``/sleep`` is under way) and another takes
the lease and finishes the job; then demand through the survivors wakes every engine, and no
request fails (those held while an engine wakes are served). No engine is ever put to sleep
twice without a wake in between (each simulator's own record of its sleep operations)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.fleet.replicas import Fleet, Replica, poll, running_fleet
from tests.waiting import wait_for
from tools.sim import FAST, RunningSim
from tools.sim.sleep import SleepRequest

pytestmark = pytest.mark.timeout(180)

MODEL = "m"  # the model replicas.py's pools serve
ENGINES = "abc"
WAKE_TIME = 0.3
RULE: dict[str, object] = {
    "idle_before_sleep": 0.5,
    "wake_time": WAKE_TIME,
    "wake_timeout": 30,
    "per_engine": 2,  # a few streams need every engine
    "headroom": 0,
}
CAPACITY: dict[str, object] = {
    "enabled": True,
    "every": 0.2,
    "lease_ttl": 2,  # a dead manager's lease lapses quickly
    "sleep_poll": 0.05,
    # Every engine awake until the test is ready: then the rule is changed through the log
    "models": {MODEL: {**RULE, "min_awake": 3}},
}
# The fleet's wait: an engine going to sleep gets its /sleep 2 x wait after the decision, time
# to kill its manager before, and for the successor to take the lease after (lease_ttl)
WAIT = 1.0
STREAMS = 8  # concurrent streams: 8 requests on the engines, 2 per engine: all 3 needed


@dataclass
class Managers:
    """Which replicas say they manage (``GET /admin/capacity``), sampled all along."""

    fleet: Fleet
    alive: list[Replica]
    rounds: list[dict[str, int | None]] = field(default_factory=list)  # managing: token
    task: asyncio.Task[None] | None = None

    async def _look(self, r: Replica) -> tuple[str, bool, int | None] | None:
        try:
            doc = await self.fleet.read(r, "/admin/capacity")
        except aiohttp.ClientError:
            if r in self.alive:
                raise
            return None  # killed while asked
        return r.name, doc["managing"], doc["look"].get("token")

    async def sample(self) -> None:
        while True:
            looks = await asyncio.gather(*(self._look(r) for r in list(self.alive)))
            self.rounds.append(
                {name: token for name, managing, token in filter(None, looks) if managing}
            )
            await asyncio.sleep(0.05)  # sleep-ok: the sampling interval of a background check

    def now(self) -> list[str]:
        return list(self.rounds[-1]) if self.rounds else []

    def check(self) -> list[tuple[str, int | None]]:
        """Never two at once; the managers in turn, each with a newer token than the last
        (None: its first turn not done yet, its look not made)."""
        if self.task is not None and self.task.done():
            self.task.result()  # the sampler's failure, if it stopped
        turns: list[tuple[str, int | None]] = []
        for i, managing in enumerate(self.rounds):
            assert len(managing) <= 1, f"two managers at once in round {i}: {managing}"
            for name, token in managing.items():
                if not turns or turns[-1][0] != name:
                    turns.append((name, token))
                elif turns[-1][1] is None:
                    turns[-1] = (name, token)
                if token is not None:
                    assert token == turns[-1][1], f"{name}'s token changed while it managed"
        tokens = [t for _, t in turns if t is not None]
        assert tokens == sorted(set(tokens)), (
            f"a manager with an older token than the last: {turns}"
        )
        return turns


@asynccontextmanager
async def sampling(managers: Managers) -> AsyncIterator[Managers]:
    task = managers.task = asyncio.create_task(managers.sample())
    try:
        yield managers
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def sleeping(session: aiohttp.ClientSession, sims: dict[str, RunningSim]) -> dict[str, bool]:
    """Each engine's own answer to ``GET /is_sleeping``."""
    got = {}
    for name, sim in sims.items():
        async with session.get(f"{sim.url}/is_sleeping") as r:
            got[name] = bool((await r.json())["is_sleeping"])
    return got


def engines(view: dict[str, Any]) -> dict[str, str]:
    """Each engine's state in a replica's ``GET /admin/capacity``."""
    return {e["backend"]: e["state"] for e in view["engines"]}


def slept_twice(sims: dict[str, RunningSim]) -> dict[str, list[str]]:
    """The engines put to sleep twice with no wake in between: their operations, in order."""
    ops: dict[str, list[str]] = {n: list(sim.state.sleep.done) for n, sim in sims.items()}
    return {
        n: o for n, o in ops.items() if any(a == b == "sleep" for a, b in itertools.pairwise(o))
    }


async def settled(
    fleet: Fleet,
    sims: dict[str, RunningSim],
    alive: list[Replica],
    asleep: int,
    meanwhile: Callable[[], None] = lambda: None,
) -> dict[str, bool]:
    """``asleep`` engines asleep by their own word, and every replica seeing the same;
    ``meanwhile``: asserts what must hold while waiting."""

    async def read() -> tuple[dict[str, bool], list[dict[str, str]], list[Any]]:
        meanwhile()
        docs = [await fleet.read(r, "/admin/capacity") for r in alive]
        looks = [d["look"].get("models", {}).get(MODEL) for d in docs if d["managing"]]
        return await sleeping(fleet.session, sims), [engines(d) for d in docs], looks

    def agreed(got: tuple[dict[str, bool], list[dict[str, str]], list[Any]]) -> bool:
        truth, views, _ = got  # the manager's look: for the message, if it comes to that
        seen = {n: "asleep" if s else "awake" for n, s in truth.items()}
        return sum(truth.values()) == asleep and all(v == seen for v in views)

    truth, _, _ = await poll(
        read, agreed, within=60, what=f"{asleep} engines asleep, as every replica sees them"
    )
    return truth


async def stream(session: aiohttp.ClientSession, replica: Replica) -> str | None:
    """One streamed chat request through ``replica``: None if answered whole, else why not."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with session.post(f"{replica.url}/v1/chat/completions", json=body) as r:
            text = await r.text()
    except aiohttp.ClientError as exc:
        return f"{replica.name}: {exc!r}"
    if r.status != 200 or not text.rstrip().endswith("data: [DONE]"):
        return f"{replica.name}: {r.status} {text[-300:]!r}"
    return None


@asynccontextmanager
async def demand(
    session: aiohttp.ClientSession, replicas: list[Replica]
) -> AsyncIterator[tuple[list[int], list[str]]]:
    """``STREAMS`` clients, each streaming one request after another through the replicas in
    turn until the block ends: (requests answered whole, failures)."""
    stop = asyncio.Event()
    done, failures = [0], []

    async def client(i: int) -> None:
        n = i
        while not stop.is_set():
            failure = await stream(session, replicas[n % len(replicas)])
            n += 1
            if failure is None:
                done[0] += 1
            else:
                failures.append(failure)

    clients = [asyncio.create_task(client(i)) for i in range(STREAMS)]
    try:
        yield done, failures
    finally:
        stop.set()
        await asyncio.gather(*clients)


async def holds(fleet: Fleet, replica: Replica) -> dict[str, float]:
    async with fleet.session.get(replica.url + "/metrics") as r:
        text = await r.text()
    return {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "llm_gateway_capacity_holds_total" and s.labels.get("model") == MODEL
    }


def kill_now(replica: Replica) -> None:
    """SIGKILL at once, from a callback (``Replica.kill`` reaps it later)."""
    assert replica.proc is not None
    replica.proc.send_signal(signal.SIGKILL)


def on_first_sleep(
    sims: dict[str, RunningSim], act: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """``act`` called when the first ``/sleep`` reaches any engine, before it sleeps; the
    engine that got it."""
    first: list[str] = []
    for name, sim in sims.items():
        mode = sim.state.sleep

        def wrapped(
            original: Callable[[SleepRequest], Awaitable[None]], name: str
        ) -> Callable[[SleepRequest], Awaitable[None]]:
            async def sleep(request: SleepRequest) -> None:
                if not first:
                    first.append(name)
                    act()
                await original(request)

            return sleep

        monkeypatch.setattr(mode, "sleep", wrapped(mode.sleep, name))
    return first


@dataclass(frozen=True, slots=True)
class Case:
    kill_at: Literal["decision", "sleep_call"]  # right after its first decision, or in its /sleep
    min_awake: int


CASES = [
    # the engine going to sleep when its manager dies: its /sleep is the successor's
    pytest.param(Case("decision", 1), id="killed-after-a-decision"),
    # its /sleep under way when its manager dies; all then asleep: the first requests held
    pytest.param(Case("sleep_call", 0), id="killed-in-a-sleep-call"),
]


async def killed_mid_way(
    fleet: Fleet,
    sims: dict[str, RunningSim],
    alive: list[Replica],
    manager: Replica,
    *,
    case: Case,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engines allowed to sleep down to ``case.min_awake``, and ``manager`` killed
    (SIGKILL) where ``case`` says."""
    sleep_called: list[str] = []
    if case.kill_at == "sleep_call":

        def kill_manager() -> None:
            alive.remove(manager)
            kill_now(manager)

        sleep_called = on_first_sleep(sims, kill_manager, monkeypatch)
    # through the log, from a replica that does not manage
    other = next(r for r in alive if r is not manager)
    rule = {"min_awake": case.min_awake}
    status, _, doc = await fleet.change(other, "PUT", f"/admin/capacity/{MODEL}", rule)
    assert status == 200, doc
    if case.kill_at == "decision":
        await wait_for(
            lambda: bool(manager.events("capacity_going_to_sleep")),
            within=15,
            what="the manager's first sleep decision",
        )
        alive.remove(manager)
        kill_now(manager)
    else:
        await wait_for(lambda: bool(sleep_called), within=15, what="the first /sleep")
    await manager.kill()
    assert not any(r.events("capacity_engine_asleep") for r in alive)  # none called /sleep yet


@pytest.mark.parametrize("case", CASES)
async def test_one_manager_at_a_time_survives_its_killing_and_leaves_none_asleep_under_demand(
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    case: Case,
) -> None:
    config = dataclasses.replace(FAST, dev_mode=True, wake_time=WAKE_TIME, served_model_name=MODEL)
    sims = {name: RunningSim(config) for name in ENGINES}
    async with AsyncExitStack() as stack:
        for sim in sims.values():
            await sim.start()
            stack.push_async_callback(sim.stop)
        fleet = await stack.enter_async_context(
            running_fleet(
                tmp_path,
                redis_url,
                redis_prefix,
                engines={name: sim.url for name, sim in sims.items()},
                capacity=CAPACITY,
                wait=WAIT,
            )
        )
        alive = list(fleet)
        managers = await stack.enter_async_context(sampling(Managers(fleet, alive)))
        await wait_for(lambda: len(managers.now()) == 1, within=15, what="one replica managing")
        (first,) = [r for r in fleet if r.name == managers.now()[0]]

        await killed_mid_way(fleet, sims, alive, first, case=case, monkeypatch=monkeypatch)
        truth = await settled(fleet, sims, alive, asleep=len(ENGINES) - case.min_awake)
        turns = managers.check()
        assert len(turns) == 2, turns  # the first, then one successor for good
        assert turns[0][0] == first.name, turns
        successor = next(r for r in alive if r.name == turns[1][0])
        assert successor.events("capacity_manager_took")
        assert successor.events("capacity_engine_asleep")  # it finished the job
        for name, sim in sims.items():  # each asleep slept once, whoever sent its /sleep
            assert sim.state.sleep.done == (["sleep"] if truth[name] else []), name

        # Demand through the survivors: every engine woken, and kept awake while it lasts
        async with demand(fleet.session, alive) as (answered, failures):

            def none_failed() -> None:  # else no demand to wake anything: say why
                assert failures == [], failures[:3]

            await settled(fleet, sims, alive, asleep=0, meanwhile=none_failed)
            since = answered[0]

            def served_more() -> bool:
                none_failed()
                return answered[0] >= since + STREAMS

            await wait_for(served_more, within=30, what="requests answered with all awake")
            assert await sleeping(fleet.session, sims) == dict.fromkeys(ENGINES, False)
            for r in alive:
                assert engines(await fleet.read(r, "/admin/capacity")) == dict.fromkeys(
                    ENGINES, "awake"
                )
        assert failures == []
        outcomes = [await holds(fleet, r) for r in alive]
        assert all(o.get("timed_out", 0) == o.get("left", 0) == 0 for o in outcomes), outcomes
        if case.min_awake == 0:  # all were asleep: the first requests were held, then served
            assert sum(o.get("served", 0) for o in outcomes) > 0, outcomes
        assert [n for n, _ in managers.check()] == [n for n, _ in turns]  # the successor, alone
        assert slept_twice(sims) == {}
        for r in alive:
            assert [e for e in r.logs if "exception" in e or "Traceback" in str(e)] == []
