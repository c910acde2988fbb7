"""The capacity manager over a real pool, with engines that record what they are told and an
injected clock: what it wants of each engine, what it calls, what it holds."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from backends.errors import NoBackendAvailable, UpstreamError
from backends.pool import BackendPool
from backends.sleep import Rest
from backends.state import BackendSpec
from gateway.capacity.book import CapacityBook
from gateway.capacity.hold import Holds
from gateway.capacity.manager import Inputs, Manager
from gateway.capacity.plan import Rule
from gateway.rollouts.driver import Never, Sole
from tests.waiting import wait_for

M = "m"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Engines:
    """Engines that sleep and wake when told (and say so to the pool, as their probes would)."""

    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool
        self.calls: list[tuple[str, str]] = []
        self.fail = False
        self.gate: asyncio.Event | None = None

    async def sleep(self, backend: BackendSpec, level: int, mode: str) -> None:
        self.calls.append(("sleep", backend.id))
        if self.fail:
            raise UpstreamError("refused")

    async def wake_up(self, backend: BackendSpec) -> None:
        self.calls.append(("wake_up", backend.id))
        if self.gate is not None:
            await self.gate.wait()


def fleet(n: int, clock: Clock) -> BackendPool:
    pool = BackendPool(
        [BackendSpec(f"e{i}", f"http://e{i}") for i in range(n)], stale_after=5, clock=clock
    )
    for b in pool.all():
        pool.record_probe(b.id, True)
        pool.record_probe(b.id, True)
        pool.record_models(b.id, [M])
        pool.record_asleep(b.id, False)
    return pool


def manager(
    pool: BackendPool,
    rule: Rule,
    *,
    held: Mapping[str, int] | None = None,
    claim: object = None,
    book: CapacityBook | None = None,
) -> tuple[Manager, Engines, CapacityBook]:
    book = book or CapacityBook(enabled=True, rules={M: rule})
    engines = Engines(pool)

    async def submit(backend: str, asleep: bool, why: str, token: int | None) -> None:
        book.accept(token)
        pool.set_sleep_wanted(backend, asleep)

    async def fleet_held() -> Mapping[str, int]:
        return held or {}

    m = Manager(
        pool,
        book,
        claim or Sole(),  # type: ignore[arg-type]
        submit=submit,
        engines=engines,
        inputs=Inputs(held=fleet_held),
        every=1.0,
        settle=0.0,
    )
    return m, engines, book


async def settle_calls(m: Manager) -> None:
    await asyncio.gather(*list(m._calls.values()))


async def test_an_idle_fleet_shrinks_to_its_minimum_one_engine_per_idle_spell() -> None:
    clock = Clock()
    pool = fleet(3, clock)
    m, engines, _ = manager(pool, Rule(idle_before_sleep=60, min_awake=1))
    await m.turn()
    assert [b.rest for b in pool.all()] == [Rest.AWAKE] * 3
    clock.t += 60
    await m.turn()  # e2 wanted asleep: no new requests, then put to sleep (it is idle)
    assert pool.get("e2").rest is Rest.GOING_TO_SLEEP  # type: ignore[union-attr]
    assert not pool.routable(pool.get("e2"), clock.t)  # type: ignore[arg-type]
    await m.turn()
    await settle_calls(m)
    assert engines.calls == [("sleep", "e2")]
    assert pool.get("e2").rest is Rest.ASLEEP  # type: ignore[union-attr]
    clock.t += 30
    await m.turn()
    await settle_calls(m)
    assert pool.get("e1").rest is Rest.AWAKE  # type: ignore[union-attr]  # not yet another spell
    clock.t += 30
    for _ in range(2):
        await m.turn()
        await settle_calls(m)
    assert [b.rest for b in pool.all()] == [Rest.AWAKE, Rest.ASLEEP, Rest.ASLEEP]
    clock.t += 600
    await m.turn()
    assert pool.get("e0").rest is Rest.AWAKE  # type: ignore[union-attr]  # min_awake 1
    assert m.asleep_seconds["e2"] > m.asleep_seconds["e1"] > 0


async def test_rising_demand_wakes_engines_before_it_arrives() -> None:
    clock = Clock()
    pool = fleet(4, clock)
    for b in pool.all()[1:]:
        pool.set_sleep_wanted(b.id, True)
        pool.record_asleep(b.id, True)
    m, engines, _ = manager(pool, Rule(per_engine=4, headroom=0, wake_time=5))
    lease = pool.acquire("e0")
    leases = [lease]
    await m.turn()
    assert engines.calls == []
    for _ in range(3):  # one more request every second: 3 now, 8 five seconds on
        clock.t += 1
        leases.append(pool.acquire("e0"))
        await m.turn()
    await settle_calls(m)
    assert pool.in_flight(pool.get("e0")) == 4  # type: ignore[arg-type]  # one engine's worth
    assert ("wake_up", "e1") in engines.calls  # woken ahead of the demand
    assert pool.get("e1").rest is Rest.AWAKE  # type: ignore[union-attr]
    for lease in leases:
        lease.release()


async def test_a_wake_calls_the_engine_in_the_turn_that_decides_it() -> None:
    """Not a turn later: the engine is awake one wake time after the decision, as forecast."""
    clock = Clock()
    pool = fleet(2, clock)
    pool.set_sleep_wanted("e1", True)
    pool.record_asleep("e1", True)
    m, engines, _ = manager(pool, Rule(min_awake=2))
    await m.turn()
    await settle_calls(m)
    assert engines.calls == [("wake_up", "e1")]
    assert pool.get("e1").rest is Rest.AWAKE  # type: ignore[union-attr]
    await m.turn()
    await settle_calls(m)
    assert engines.calls == [("wake_up", "e1")]  # once
    assert m.decisions["wake", "made"] == m.decisions["wake_up", "made"] == 1


async def test_a_failed_sleep_call_leaves_the_engine_going_to_sleep_and_is_tried_again() -> None:
    clock = Clock()
    pool = fleet(2, clock)
    m, engines, _ = manager(pool, Rule(idle_before_sleep=0))
    engines.fail = True
    await m.turn()
    await m.turn()
    await settle_calls(m)
    assert pool.get("e1").rest is Rest.GOING_TO_SLEEP  # type: ignore[union-attr]
    assert m.decisions["put_to_sleep", "failed"] == 1
    engines.fail = False
    await m.turn()
    await settle_calls(m)
    assert pool.get("e1").rest is Rest.ASLEEP  # type: ignore[union-attr]


async def test_a_restarted_engine_wanted_asleep_is_put_back_to_sleep() -> None:
    clock = Clock()
    pool = fleet(2, clock)
    pool.set_sleep_wanted("e1", True)
    pool.record_asleep("e1", True)
    m, engines, _ = manager(pool, Rule())
    pool.record_asleep("e1", False)  # restarted: awake, whatever was wanted
    assert pool.get("e1").rest is Rest.GOING_TO_SLEEP  # type: ignore[union-attr]
    await m.turn()
    await settle_calls(m)
    assert engines.calls == [("sleep", "e1")]


async def test_a_replica_that_does_not_hold_the_lease_decides_nothing() -> None:
    clock = Clock()
    pool = fleet(2, clock)
    m, engines, _ = manager(pool, Rule(idle_before_sleep=0), claim=Never())
    assert await m.turn() is None
    assert [b.rest for b in pool.all()] == [Rest.AWAKE] * 2
    assert engines.calls == []


async def test_a_stale_managers_decision_is_refused() -> None:
    clock = Clock()
    pool = fleet(2, clock)
    m, _, book = manager(pool, Rule(idle_before_sleep=0))
    book.token = 7  # a newer manager decided since (Sole hands out max(1, 7): not stale)
    await m.turn()
    assert m.token == 7
    book.token = 9

    class Stale:  # a lease that was lost: its holder believes it still has token 8
        async def acquire(self, at_least: int = 0) -> int | None:
            return 8

        async def release(self) -> bool:
            return True

    m2, _, _ = manager(pool, Rule(idle_before_sleep=0), claim=Stale(), book=book)
    pool.set_sleep_wanted("e1", False)
    await m2.turn()
    assert m2.decisions["sleep", "refused"] == 1
    assert pool.get("e1").rest is Rest.AWAKE  # type: ignore[union-attr]


async def test_a_replica_managing_again_waits_an_idle_spell_of_its_own_before_a_sleep() -> None:
    """Demand went unseen here while another replica managed: the idle spell of this one's
    last term is not carried over into the next."""
    clock = Clock()
    pool = fleet(3, clock)

    class Lapsing:  # the lease held, lost to another replica, then taken again
        token: int | None = 1

        async def acquire(self, at_least: int = 0) -> int | None:
            return self.token

        async def release(self) -> bool:
            return True

    claim = Lapsing()
    m, _, _ = manager(pool, Rule(idle_before_sleep=60, min_awake=1), claim=claim)
    await m.turn()  # idle from now on, as far as it sees
    claim.token = None
    clock.t += 300
    assert await m.turn() is None  # another manages (and sees demand) for 300 s
    claim.token = 2
    await m.turn()
    assert [b.rest for b in pool.all()] == [Rest.AWAKE] * 3
    clock.t += 60
    await m.turn()  # a whole spell seen idle in this term: now one sleeps
    assert [b.rest for b in pool.all()].count(Rest.GOING_TO_SLEEP) == 1


async def test_a_request_for_a_model_asleep_is_held_until_an_engine_wakes() -> None:
    clock = Clock()
    pool = fleet(2, clock)
    for b in pool.all():
        pool.set_sleep_wanted(b.id, True)
        pool.record_asleep(b.id, True)
    m, engines, _ = manager(pool, Rule(min_awake=0))
    engines.gate = asyncio.Event()
    holds = Holds(pool, lambda _m: 30.0, m.wake_for)
    held = asyncio.create_task(holds.hold(M))
    await wait_for(lambda: bool(engines.calls), within=5, what="the engine told to wake")
    assert holds.held[M] == 1
    assert not held.done()
    assert pool.get("e0").rest is Rest.WAKING  # type: ignore[union-attr]  # wanted awake
    engines.gate.set()  # awake: the pool hears it, the held request goes
    assert await held is True
    assert engines.calls == [("wake_up", "e0")]
    assert holds.held == {}
    assert holds.outcomes[M, "served"] == 1


async def test_a_hold_ends_with_the_usual_refusal_after_the_wake_timeout() -> None:
    clock = Clock()
    pool = fleet(1, clock)
    pool.set_sleep_wanted("e0", True)
    pool.record_asleep("e0", True)
    woken: list[str] = []
    holds = Holds(pool, lambda _m: 0.01, lambda model, _only: woken.append(model))
    with pytest.raises(NoBackendAvailable, match="woke within"):
        await holds.hold(M)
    assert woken == [M]
    assert holds.held == {}
    assert holds.outcomes[M, "timed_out"] == 1


async def test_nothing_is_held_for_a_model_whose_engines_do_not_sleep() -> None:
    clock = Clock()
    pool = fleet(1, clock)
    pool.record_probe("e0", False)
    holds = Holds(pool, lambda _m: 30.0, lambda _m, _o: None)
    assert await holds.hold(M) is False
    assert holds.held == {}


async def test_a_rule_may_name_a_model_pool_whose_engines_alone_it_manages() -> None:
    clock = Clock()
    pool = fleet(3, clock)
    book = CapacityBook(enabled=True, rules={"canary": Rule(min_awake=0, idle_before_sleep=0)})

    async def submit(backend: str, asleep: bool, why: str, token: int | None) -> None:
        book.accept(token)
        pool.set_sleep_wanted(backend, asleep)

    async def no_holds() -> Mapping[str, int]:
        return {}

    pools = {"stable": frozenset({"e0", "e1"}), "canary": frozenset({"e2"})}
    m = Manager(
        pool,
        book,
        Sole(),
        submit=submit,
        engines=Engines(pool),
        inputs=Inputs(held=no_holds, pools=lambda: pools),
        every=1.0,
        settle=0.0,
    )
    await m.turn()
    await m.turn()
    await settle_calls(m)
    assert [b.rest for b in pool.all()] == [Rest.AWAKE, Rest.AWAKE, Rest.ASLEEP]
    assert m.look["models"]["canary"]["need"] == 0


async def test_a_manager_that_lost_its_lease_puts_nothing_to_sleep() -> None:
    clock = Clock()
    pool = fleet(2, clock)

    class Lapsing:  # held for the turn's decision, lost by the time of the engine call
        def __init__(self) -> None:
            self.calls = 0

        async def acquire(self, at_least: int = 0) -> int | None:
            self.calls += 1
            return 1 if self.calls == 1 else None

        async def release(self) -> bool:
            return True

    m, engines, _ = manager(pool, Rule(idle_before_sleep=0), claim=Lapsing())
    pool.set_sleep_wanted("e1", True)  # going to sleep, idle: put to sleep this turn
    await m.turn()
    await settle_calls(m)
    assert engines.calls == []
    assert m.decisions["put_to_sleep", "refused"] == 1
