"""The capacity manager: one replica at a time (a lease) follows each managed model's demand.

Each turn (every ``every`` seconds, or at once when a request is held): take or keep the
lease; measure each model's demand (the requests on its engines, as they report them or as
the gateway has them in flight, whichever is more, plus the requests held here and on the
other replicas) and its trend; decide (``gateway.capacity.plan.decide``); carry the steps out:

- ``sleep`` / ``wake``: what the fleet wants of an engine, appended to the fleet's log under
  the lease's fencing token (``submit``), applied by every replica (no new requests to an
  engine going to sleep; a woken one taken back once awake);
- ``put_to_sleep``: ``POST /sleep`` to an engine going to sleep that has finished its work (or
  ran out of time), once every replica has had time to stop sending it any (``settle``);
- ``wake_up``: ``POST /wake_up`` to an engine wanted awake and still asleep (called in the
  turn that decided the wake, or in a later one if that call failed or the engine was still
  being put to sleep).

Engine calls run as tasks of their own, one at a time per engine, so a slow wake holds no
turn up. Every decision is logged with its reason and counted. The manager knows the engines'
real states only from what they say (``backends.monitor``: ``/is_sleeping``), so a restarted
engine or replica leaves nothing believed asleep that is awake.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from backends.errors import GatewayError, UpstreamError
from backends.pool import BackendPool
from backends.sleep import Rest
from backends.state import BackendSpec, BackendState
from backends.upstream.client import Transport
from gateway.capacity.book import CapacityBook
from gateway.capacity.demand import Trend, smoothing
from gateway.capacity.plan import Demand, Engine, EngineStep, Need, Rule, Turn, decide
from gateway.capacity.settings import rule_doc
from gateway.rollouts.driver import Claim

log = structlog.get_logger("gateway.capacity")


class EngineCalls(Protocol):
    """How the manager tells an engine to sleep or wake (vLLM's dev-mode routes)."""

    async def sleep(self, backend: BackendSpec, level: int, mode: str) -> None: ...

    async def wake_up(self, backend: BackendSpec) -> None: ...


# What the fleet wants of ``backend`` (asleep: True), why, under which fencing token (None: not
# a manager's), appended to the fleet's log (or applied here, without one). Raises if refused.
Submit = Callable[[str, bool, str, int | None], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Inputs:
    """What the manager reads besides the pool, each turn."""

    held: Callable[[], Awaitable[Mapping[str, int]]]  # requests held per model, fleet-wide
    ttft: Callable[[], Mapping[str, float]] = dict  # recent time to first token per model
    # the model pools (``[[pools]]``): name -> its backends; a rule may name a pool
    pools: Callable[[], Mapping[str, frozenset[str]]] = dict


class Manager:
    def __init__(
        self,
        pool: BackendPool,
        book: CapacityBook,
        claim: Claim,
        *,
        submit: Submit,
        engines: EngineCalls,
        inputs: Inputs,
        every: float,
        settle: float,
        trend_window: float = 30.0,
    ) -> None:
        self._pool = pool
        self._book = book
        self._claim = claim
        self._submit = submit
        self._engines = engines
        self._inputs = inputs
        self._every = every
        self._settle = settle
        self._trend_window = trend_window
        self._trends: dict[str, Trend] = {}
        self._low: dict[str, float] = {}
        self._calls: dict[str, asyncio.Task[None]] = {}
        self._poked = asyncio.Event()
        self._groups: dict[str, frozenset[str]] = {}  # engine -> the models and pools it is in
        self._last_turn: float | None = None
        self.token: int | None = None  # while this replica manages: its fencing token
        self.decisions: Counter[tuple[str, str]] = Counter()  # (action, outcome)
        self.asleep_seconds: dict[str, float] = {}  # per engine, counted while managing
        self.look: dict[str, Any] = {}  # the last turn, for the admin API and reports
        self.needs: dict[str, Need] = {}  # the last turn's, per model
        self.turns = 0  # turns made while managing

    def poke(self) -> None:
        """Turn now (a request is held)."""
        self._poked.set()

    def wake_for(self, model: str, only: Collection[str] | None) -> None:
        """A request for ``model`` is held here: an engine serving it woken now, whichever
        replica manages (the first going to sleep, still warm, else the first asleep: every
        replica picks the same), through the fleet's log and its ``/wake_up``."""
        self.poke()
        serving = sorted(
            (
                b
                for b in self._pool.serving(model)
                if (only is None or b.id in only) and b.up and b.spec.role != "prefill"
            ),
            key=lambda b: (b.rest is Rest.ASLEEP, b.id),
        )
        if any(b.rest is Rest.WAKING for b in serving):
            for b in serving:
                if b.rest is Rest.WAKING and b.id not in self._calls:
                    step = EngineStep("wake_up", b.id, f"{model}: a request held")
                    self._calls[b.id] = _detached(self._call(b, step))
            return
        sleepers = [b for b in serving if b.rest in (Rest.ASLEEP, Rest.GOING_TO_SLEEP)]
        if not sleepers or sleepers[0].id in self._calls:
            return
        b = sleepers[0]
        self._calls[b.id] = _detached(self._wake_held(b, model))

    async def _wake_held(self, b: BackendState, model: str) -> None:
        why = f"{model}: a request held for a wake"
        try:
            try:
                await self._submit(b.id, False, why, None)
            except GatewayError as exc:
                log.warning("capacity_wake_refused", backend=b.id, why=why, error=exc.message)
                return
            self.decisions["wake", "made"] += 1
            log.info("capacity_waking", backend=b.id, why=why, term=None)
            if b.asleep:  # the same task: no other call to it meanwhile
                await self._call(b, EngineStep("wake_up", b.id, why))
        finally:
            if self._calls.get(b.id) is asyncio.current_task():
                del self._calls[b.id]

    async def run(self) -> None:
        """Turn every ``every`` seconds until cancelled; a failed turn is logged, not fatal."""
        try:
            while True:
                try:
                    await self.turn()
                except Exception as exc:  # Redis down, a change refused...: the next turn again
                    log.warning("capacity_turn_failed", error=str(exc) or type(exc).__name__)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._every):
                        await self._poked.wait()
                self._poked.clear()
        finally:
            for task in self._calls.values():
                task.cancel()
            await asyncio.gather(*self._calls.values(), return_exceptions=True)
            if self.token is not None:
                with contextlib.suppress(Exception):
                    await self._claim.release()

    async def turn(self) -> Turn | None:
        """One look at every managed model; None if another replica manages."""
        book = self._book
        if not book.enabled:
            return None
        token = await self._claim.acquire(book.token)
        if token is None:
            if self.token is not None:
                log.info("capacity_manager_lost", term=self.token)
            self.token, self.look, self.needs, self._last_turn = None, {}, {}, None
            return None
        if self.token != token:
            log.info("capacity_manager_took", term=token)
            self.token = token
            # A new term: an idle spell counts from what this replica sees now, not from its
            # last term (another managed meanwhile, demand unseen here)
            self._low = {}
        now = self._pool.now()
        engines = [b for b in self._pool.all() if not b.removed]
        self._groups = _groups(engines, self._inputs.pools())
        self._count_asleep(engines, now)
        held = await self._inputs.held()
        ttft = self._inputs.ttft()
        demands = {
            m: self._demand(m, rule, engines, held.get(m, 0), now, ttft.get(m))
            for m, rule in book.rules.items()
        }
        views = [self._engine(b) for b in engines]
        turn = decide(
            book.rules, demands, views, now, self._low, default=Rule(), settle=self._settle
        )
        self._low, self.needs = turn.low_since, turn.needs
        for step in turn.steps:
            await self._carry_out(step, token)
        self.look = self._look(turn, demands, engines, now)
        self.turns += 1
        return turn

    # -- reading ---------------------------------------------------------------------------

    def _load(self, b: BackendState, now: float) -> float:
        snap = self._pool.snapshot(b, now)
        scraped = (snap.queue_depth or 0) + (snap.running or 0)
        return float(max(scraped, self._pool.in_flight(b)))

    def _engine(self, b: BackendState) -> Engine:
        now = self._pool.now()
        return Engine(
            b.id,
            b.rest,
            self._groups[b.id],
            self._load(b, now),
            b.up,
            b.rest_since,
            can_sleep=b.asleep is not None,
        )

    def _demand(  # noqa: PLR0917
        self,
        model: str,
        rule: Rule,
        engines: list[BackendState],
        held: int,
        now: float,
        ttft: float | None,
    ) -> Demand:
        serving = [b for b in engines if model in self._groups[b.id] and b.up]
        load = sum(self._load(b, now) for b in serving) + held
        trend = self._trends.get(model)
        if trend is None:
            trend = self._trends[model] = Trend(self._trend_window)
        trend.smooth = smoothing(rule.wake_time, self._trend_window)  # the rule may change
        trend.add(now, load)
        kvs = [
            s.kv_cache_usage
            for b in serving
            if b.rest is Rest.AWAKE
            and (s := self._pool.snapshot(b, now)).kv_cache_usage is not None
        ]
        return Demand(
            load=trend.level,
            trend=trend.slope,
            held=held,
            ttft=ttft,
            kv=max(kvs) if kvs else None,
        )

    def _count_asleep(self, engines: list[BackendState], now: float) -> None:
        """Engine-seconds asleep since the last turn (counted by the managing replica only, so
        the fleet's sum is each second once)."""
        if self._last_turn is not None:
            dt = max(0.0, now - self._last_turn)
            for b in engines:
                if b.asleep:
                    self.asleep_seconds[b.id] = self.asleep_seconds.get(b.id, 0.0) + dt
        self._last_turn = now

    # -- acting ----------------------------------------------------------------------------

    async def _carry_out(self, step: EngineStep, token: int) -> None:
        b = self._pool.get(step.engine)
        if b is None:
            return
        if step.action in ("sleep", "wake"):
            asleep = step.action == "sleep"
            try:
                await self._submit(b.id, asleep, step.why, token)
            except GatewayError as exc:
                self.decisions[step.action, "refused"] += 1
                log.warning(
                    "capacity_decision_refused",
                    action=step.action,
                    backend=b.id,
                    why=step.why,
                    error=exc.message,
                )
                return
            self.decisions[step.action, "made"] += 1
            log.info(
                "capacity_going_to_sleep" if asleep else "capacity_waking",
                backend=b.id,
                why=step.why,
                term=token,
            )
            if not asleep and b.asleep and b.id not in self._calls:
                # woken now, not at the next turn: the forecast looked one wake time ahead
                self._calls[b.id] = asyncio.create_task(
                    self._call(b, EngineStep("wake_up", b.id, step.why))
                )
            return
        if b.id in self._calls:  # a call under way: its answer first
            return
        self._calls[b.id] = asyncio.create_task(self._call(b, step))

    async def _call(self, b: BackendState, step: EngineStep) -> None:
        try:
            try:
                if step.action == "put_to_sleep":
                    if not await self._still_managing(b, step):
                        return
                    await self._engines.sleep(b.spec, step.level, step.mode)
                else:
                    await self._engines.wake_up(b.spec)
            except (UpstreamError, TimeoutError) as exc:
                self.decisions[step.action, "failed"] += 1
                message = exc.message if isinstance(exc, UpstreamError) else "timed out"
                log.warning("capacity_call_failed", action=step.action, backend=b.id, error=message)
                return
            self.decisions[step.action, "made"] += 1
            asleep = step.action == "put_to_sleep"
            self._pool.record_asleep(b.id, asleep)  # here at once; elsewhere at their next look
            log.info(
                "capacity_engine_asleep" if asleep else "capacity_engine_awake",
                backend=b.id,
                why=step.why,
                level=step.level if asleep else None,
                mode=step.mode if asleep else None,
            )
        finally:
            if self._calls.get(b.id) is asyncio.current_task():
                del self._calls[b.id]

    async def _still_managing(self, b: BackendState, step: EngineStep) -> bool:
        """Right before a ``/sleep``: this replica still holds the lease under its token, and
        the engine is still wanted asleep (a manager that stalled past its lease, and came
        back, puts nothing to sleep that its successor took back)."""
        try:
            token = await self._claim.acquire(self._book.token)
        except Exception as exc:  # Redis out of reach: not known, so not done
            log.warning("capacity_call_skipped", backend=b.id, why=str(exc) or type(exc).__name__)
            return False
        if token is None or token != self.token or b.rest is not Rest.GOING_TO_SLEEP:
            self.decisions[step.action, "refused"] += 1
            log.warning(
                "capacity_call_skipped",
                backend=b.id,
                why="lease lost" if token != self.token else f"engine {b.rest.value}",
            )
            return False
        return True

    def _look(
        self, turn: Turn, demands: Mapping[str, Demand], engines: list[BackendState], now: float
    ) -> dict[str, Any]:
        models: dict[str, Any] = {}
        for model, rule in self._book.rules.items():
            n = turn.needs.get(model)
            d = demands.get(model)
            models[model] = {
                "rule": rule_doc(rule),
                "load": None if d is None else round(d.load, 2),
                "trend_per_s": None if d is None else round(d.trend, 3),
                "held": None if d is None else d.held,
                "need": None if n is None else n.engines,
                "desired": None if n is None else n.desired,
                "why": None if n is None else n.why,
                "awake": sum(model in self._groups[b.id] and b.rest is Rest.AWAKE for b in engines),
                "idle_for_s": None
                if model not in turn.low_since
                else round(now - turn.low_since[model], 1),
            }
        return {
            "token": self.token,
            "models": models,
            "steps": [{"action": s.action, "backend": s.engine, "why": s.why} for s in turn.steps],
            "asleep_seconds": round(sum(self.asleep_seconds.values()), 1),
        }


def _groups(
    engines: list[BackendState], pools: Mapping[str, frozenset[str]]
) -> dict[str, frozenset[str]]:
    """What each engine is one of, for the rules: the models it serves and the pools it is in
    (a rule names either)."""
    return {
        b.id: b.models | {name for name, members in pools.items() if b.id in members}
        for b in engines
    }


def _detached(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """A task of the manager's started from a request's handler, without the request's
    context (its log lines are the manager's, not the request's)."""
    return asyncio.create_task(coro, context=contextvars.Context())


class HttpEngines:
    """``EngineCalls`` over the gateway's transport to the backends."""

    def __init__(self, transport: Transport, timeout: float) -> None:
        self._transport = transport
        self._timeout = timeout

    async def sleep(self, backend: BackendSpec, level: int, mode: str) -> None:
        await self._post(backend, f"/sleep?level={level}&mode={mode}")

    async def wake_up(self, backend: BackendSpec) -> None:
        await self._post(backend, "/wake_up")

    async def _post(self, backend: BackendSpec, path: str) -> None:
        transport = self._transport
        async with asyncio.timeout(self._timeout):
            upstream = await transport.open(backend, path, b"", {})
            try:
                text = (await transport.read_body(upstream)).decode(errors="replace")
            finally:
                transport.finish(upstream, complete=True)
        if upstream.status != 200:
            raise UpstreamError(f"{path} answered {upstream.status}: {text[:200]}")
