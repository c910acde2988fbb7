"""What the capacity manager decides each turn: which engines to wake, which to put to sleep.
Pure: plain data in (the rules, each model's demand, the engines as the pool sees them, the
time), steps out; no I/O, no clock of its own.

Per model with a rule, the engines it needs awake (``need``) are its demand one wake time
ahead (the requests on its engines and held or queued in the gateway now, plus the trend
times ``wake_time``: a rising demand wakes engines before it arrives), with ``headroom`` on
top, divided by what one engine serves (``per_engine``); one more than awake while the time to
first token is over the model's objective or the KV cache is nearly full; clamped to
``min_awake`` .. ``max_awake``, and at least one while a request is held for a wake.

Then (``decide``):

- **more needed than awake or waking**: wake the shortfall, first the engines going to sleep
  (still warm: they only stop taking new work), then those asleep;
- **fewer needed than awake**, continuously for ``idle_before_sleep`` seconds, nothing waking
  or going to sleep: one engine (the least loaded, one no other model needs) goes to sleep;
  the next one only after another such spell;
- an engine **going to sleep** is put to sleep once it has nothing left to do (or after
  ``drain_timeout``: then vLLM's sleep ``mode`` says what becomes of what is left);
- an engine **waking** (wanted awake, still asleep: woken by hand, or restarted replica's
  view) is woken.

A model is never left without an awake engine unless its rule allows zero (``min_awake = 0``);
then a request for it is held while an engine wakes (``gateway.capacity.hold``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from backends.sleep import Rest

SleepMode = Literal["abort", "wait", "keep"]
EngineAction = Literal["wake", "sleep", "put_to_sleep", "wake_up"]
_EPS: Final = 1e-9


@dataclass(frozen=True, slots=True)
class Rule:
    """How the engines of one model follow its demand."""

    min_awake: int = 1
    max_awake: int | None = None  # None: every engine serving it
    headroom: float = 0.25  # share of the forecast kept awake on top of it
    per_engine: float = 8.0  # requests (running or waiting) one engine serves within its SLO
    sleep_level: int = 1  # vLLM's: 1 offloads the weights (wakes in seconds), 2 drops them
    sleep_mode: SleepMode = "wait"  # what vLLM does with requests still on it when put to sleep
    idle_before_sleep: float = 60.0  # demand below the awake engines this long: one sleeps
    drain_timeout: float = 120.0  # the longest a going-to-sleep engine is let finish its work
    wake_time: float = 5.0  # how long a wake takes: the forecast looks this far ahead
    wake_timeout: float = 30.0  # the longest a request is held while an engine wakes
    ttft_slo: float | None = None  # time to first token (s) above which one more is woken
    kv_high: float = 0.9  # KV cache use of the awake engines above which one more is woken

    def __post_init__(self) -> None:
        if self.min_awake < 0 or (self.max_awake is not None and self.max_awake < self.min_awake):
            raise ValueError("capacity: 0 <= min_awake <= max_awake")
        if self.per_engine <= 0 or self.headroom < 0:
            raise ValueError("capacity: per_engine > 0 and headroom >= 0")
        if self.sleep_level not in (0, 1, 2):
            raise ValueError("capacity: sleep_level is 0, 1 or 2")
        times = (self.idle_before_sleep, self.drain_timeout, self.wake_time, self.wake_timeout)
        if not all(math.isfinite(t) and t >= 0 for t in times):
            raise ValueError("capacity: times are seconds >= 0")


@dataclass(frozen=True, slots=True)
class Demand:
    """One model's demand as the manager measured it (``gateway.capacity.demand``)."""

    load: float  # requests on its engines (running or waiting) and held or queued in the gateway
    trend: float = 0.0  # how fast ``load`` grows, per second
    held: int = 0  # requests held for lack of an awake engine
    ttft: float | None = None  # recent time to first token (s), where known
    kv: float | None = None  # the highest KV cache use among its awake engines


@dataclass(frozen=True, slots=True)
class Engine:
    """A backend as the manager sees it."""

    id: str
    rest: Rest
    models: frozenset[str]
    load: float = 0.0  # requests on it, running or waiting
    up: bool = True
    since: float = 0.0  # when its rest last changed
    can_sleep: bool = True  # it answers /is_sleeping (vLLM in dev mode): it can be put to sleep


@dataclass(frozen=True, slots=True)
class Need:
    model: str
    engines: int  # awake wanted, within the rule's bounds and the engines there are
    desired: int  # what the demand asks for, unbounded (the autoscaler's signal)
    why: str


@dataclass(frozen=True, slots=True)
class EngineStep:
    action: EngineAction
    engine: str
    why: str
    level: int = 1
    mode: SleepMode = "wait"


@dataclass(slots=True)
class Turn:
    steps: list[EngineStep] = field(default_factory=list)
    needs: dict[str, Need] = field(default_factory=dict)
    low_since: dict[str, float] = field(default_factory=dict)  # carried to the next turn


def need(model: str, rule: Rule, demand: Demand, awake: int, engines: int) -> Need:
    """The engines ``model`` needs awake now, of ``engines`` serving it (``awake`` awake)."""
    ahead = demand.load + max(demand.trend, 0.0) * rule.wake_time
    desired = math.ceil(ahead * (1 + rule.headroom) / rule.per_engine - _EPS)
    why = (
        f"{demand.load:.1f} requests, {demand.trend:+.2f}/s: {ahead:.1f} in {rule.wake_time:g} s"
        f" with {rule.headroom:.0%} headroom at {rule.per_engine:g} per engine"
    )
    slow = rule.ttft_slo is not None and demand.ttft is not None and demand.ttft > rule.ttft_slo
    if slow and awake + 1 > desired:
        desired = awake + 1
        why = f"time to first token {demand.ttft:.3f} s over the {rule.ttft_slo:g} s objective"
    if demand.kv is not None and demand.kv > rule.kv_high and awake + 1 > desired:
        desired = awake + 1
        why = f"KV cache {demand.kv:.0%} used, over {rule.kv_high:.0%}"
    if demand.held > 0 and desired < 1:
        desired = 1
        why = f"{demand.held} requests held for a wake"
    top = engines if rule.max_awake is None else min(rule.max_awake, engines)
    wanted = max(min(desired, top), min(rule.min_awake, engines))
    if wanted != desired:
        why += f"; {wanted} within min_awake {rule.min_awake}, max {top}"
    return Need(model, wanted, desired, why)


def decide(
    rules: Mapping[str, Rule],
    demands: Mapping[str, Demand],
    engines: Sequence[Engine],
    now: float,
    low_since: Mapping[str, float],
    *,
    default: Rule | None = None,
    settle: float = 0.0,
) -> Turn:
    """This turn's steps (``low_since``: since when each model has needed fewer engines than
    awake, as the last turn left it). ``default``: the rule for what an engine serving no
    ruled model is told by hand (how it is put to sleep). ``settle``: how long an engine has
    been going to sleep before it is put to sleep at the earliest (every replica has stopped
    sending it requests by then)."""
    turn = Turn()
    up = [e for e in engines if e.up]
    serving = {m: [e for e in up if m in e.models] for m in rules}
    awake = {m: sum(e.rest is Rest.AWAKE for e in es) for m, es in serving.items()}
    for model, rule in rules.items():
        es = serving[model]
        if es:
            d = demands.get(model, Demand(0.0))
            turn.needs[model] = need(model, rule, d, awake[model], len(es))
    woken: set[str] = set()
    for model, n in turn.needs.items():
        es = serving[model]
        by = {r: [e for e in es if e.rest is r] for r in Rest}
        ready = len(by[Rest.AWAKE]) + len(by[Rest.WAKING])
        if n.engines > ready:
            warm = sorted(by[Rest.GOING_TO_SLEEP], key=lambda e: (-e.load, e.id))
            cold = sorted(by[Rest.ASLEEP], key=lambda e: e.id)
            for e in [e for e in (*warm, *cold) if e.id not in woken][: n.engines - ready]:
                woken.add(e.id)
                turn.steps.append(EngineStep("wake", e.id, f"{model}: needs {n.engines}: {n.why}"))
            continue
        if n.engines >= len(by[Rest.AWAKE]):
            continue  # the spell of low demand, if any, is over
        since = low_since.get(model, now)
        turn.low_since[model] = since
        moving = by[Rest.WAKING] or by[Rest.GOING_TO_SLEEP]
        if moving or now - since < rules[model].idle_before_sleep:
            continue
        pick = _to_sleep(by[Rest.AWAKE], turn, awake, woken)
        if pick is not None:
            turn.low_since[model] = now  # the next one after another idle spell
            for m in pick.models & awake.keys():
                awake[m] -= 1
            turn.steps.append(
                EngineStep(
                    "sleep",
                    pick.id,
                    f"{model}: needs {n.engines} of {len(by[Rest.AWAKE])} awake for"
                    f" {now - since:.0f} s: {n.why}",
                )
            )
    turn.steps.extend(
        _reconcile(rules, up, now, woken=woken, default=default or Rule(), settle=settle)
    )
    return turn


def _to_sleep(
    candidates: Sequence[Engine], turn: Turn, awake: Mapping[str, int], woken: set[str]
) -> Engine | None:
    """The least loaded awake engine whose sleep leaves every model it serves enough."""
    # Ties: the last by id, so that the same engines stay awake turn after turn
    by_id = sorted(candidates, key=lambda e: e.id, reverse=True)
    for e in sorted(by_id, key=lambda e: e.load):
        if e.id in woken or not e.can_sleep:
            continue
        if all(awake[m] - 1 >= turn.needs[m].engines for m in e.models if m in turn.needs):
            return e
    return None


def _reconcile(
    rules: Mapping[str, Rule],
    engines: Sequence[Engine],
    now: float,
    *,
    woken: set[str],
    default: Rule,
    settle: float,
) -> list[EngineStep]:
    """Each engine's real state moved towards the one wanted: one going to sleep and done (or
    out of time) put to sleep; one wanted awake and still asleep woken."""
    steps: list[EngineStep] = []
    for e in engines:
        rule = next((rules[m] for m in sorted(e.models) if m in rules), default)
        if e.rest is Rest.WAKING:
            steps.append(EngineStep("wake_up", e.id, "wanted awake, still asleep"))
        elif e.rest is Rest.GOING_TO_SLEEP and not e.can_sleep:
            # wanted asleep by hand, or before it lost its dev mode: it would take no work
            steps.append(
                EngineStep("wake", e.id, "it cannot sleep (no /is_sleeping: not in dev mode)")
            )
        elif e.rest is Rest.GOING_TO_SLEEP and e.id not in woken:
            waited = now - e.since
            if waited >= settle and (e.load <= 0 or waited >= rule.drain_timeout):
                why = "idle" if e.load <= 0 else f"{e.load:g} requests left after {waited:.0f} s"
                steps.append(
                    EngineStep(
                        "put_to_sleep", e.id, why, level=rule.sleep_level, mode=rule.sleep_mode
                    )
                )
    return steps
