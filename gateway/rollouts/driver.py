"""Drives the fleet's progressive rollouts: one replica at a time per rollout (a lease), each
turn judging the canary on the fleet's figures and, when the plan says so, appending the
decision to the fleet's log, which every replica applies (``gateway.admin.rollouts``).

Each turn, for every rollout under way: take (or keep) its lease; read the fleet's counts of
both pools; if the step's window has no start yet (a new rollout), record one (the fleet's
counts now); else judge the window (``gateway.rollouts.plan.decide``) and hold, advance,
promote or abort. A decision carries the lease's fencing token and the step it is for, so a
driver that lost its lease, or a decision made twice, is refused where it is applied: each
step happens once, whoever drives. A replica that dies stops renewing; the next turn of
another replica after ``lease_ttl`` takes over from the step the log records.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import structlog

from backends.errors import GatewayError
from gateway.fleet.figures import Figures, PoolCounts, summed
from gateway.rollouts.plan import Plan, Verdict, decide
from gateway.rollouts.state import Baseline, RolloutBook, Run, baseline_doc, plan_fingerprint

log = structlog.get_logger("gateway.rollouts")


class Claim(Protocol):
    """A duty's lease (``gateway.fleet.lease.DutyLease``: a rollout's, the capacity manager's), or
    what stands for one. ``at_least``: the least fencing token a new holder gets."""

    async def acquire(self, at_least: int = 0) -> int | None: ...

    async def release(self) -> bool: ...


class Sole:
    """The only driver there is (one process, or the first worker of a host): always held."""

    async def acquire(self, at_least: int = 0) -> int | None:
        return max(1, at_least)

    async def release(self) -> bool:
        return True


class Never:
    """Another process drives (the other workers of a host whose fleet is in files)."""

    async def acquire(self, at_least: int = 0) -> int | None:
        return None

    async def release(self) -> bool:
        return False


# The share of identical tokens in both pools' answers to the plan's probes (``gates.agreement``)
Probe = Callable[[Plan], Awaitable[float]]

# A decision for ``alias`` (the body of POST /admin/rollouts/{alias}/decision), appended to the
# fleet's log and applied; raises if it could not be.
SubmitDecision = Callable[[str, dict[str, Any]], Awaitable[None]]


def window(counted: Baseline, began: Baseline, pool: str) -> PoolCounts:
    """``pool``'s counts since the window began, summed over the replicas: each one's since its
    own reading then (all of a replica's that joined since; none of one that left)."""
    zero = PoolCounts()
    return summed(
        pools.get(pool, zero).since(began.get(replica, {}).get(pool, zero))
        for replica, pools in counted.items()
    )


class Driver:
    def __init__(
        self,
        book: RolloutBook,
        figures: Callable[[], Awaitable[dict[str, Figures]]],  # each replica's
        submit: SubmitDecision,
        claim: Callable[[str], Claim],
        *,
        every: float,
        clock: Callable[[], float] = time.time,
        on_abort: Callable[[str, Verdict], None] | None = None,
        probe: Probe | None = None,
        configured: Callable[[], Sequence[Plan]] = tuple,
        start: Callable[[Plan], Awaitable[None]] | None = None,
    ) -> None:
        self._book = book
        self._figures = figures
        self._submit = submit
        self._claim = claim
        self._every = every
        self._clock = clock
        self._on_abort = on_abort
        self._claims: dict[str, Claim] = {}
        self._probe = probe
        self._configured = configured  # the configuration file's plans, as it reads now
        self._start = start
        self._refused: set[str] = set()  # configured plans refused: said once each
        self._agreement: dict[tuple[str, float], float] = {}  # (alias, step began): once a step
        # The last look at each rollout driven here (``Verdict.doc``, and ``at``: when), which
        # this replica's reports carry to the fleet's consoles
        self.progress: dict[str, dict[str, Any]] = {}

    async def run(self) -> None:
        """Turn every ``every`` seconds until cancelled; a failed turn is logged, not fatal."""
        try:
            while True:
                try:
                    await self.turn()
                except Exception as exc:  # Redis down, a change refused...: the next turn again
                    log.warning("rollout_turn_failed", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(self._every)  # sleep-ok: the driver's period
        finally:
            for claim in self._claims.values():
                with contextlib.suppress(Exception):
                    await claim.release()

    async def turn(self) -> None:
        """One look at every rollout under way (and the leases of those that ended given up),
        once the configuration file's plans not started yet are."""
        for plan in self._configured():
            if self._start is not None and self._book.now.unstarted(plan):
                await self._start_configured(plan, self._start)
        active = {run.plan.alias: run for run in self._book.now.active()}
        for alias in [a for a in self._claims if a not in active]:
            self.progress.pop(alias, None)
            await self._claims.pop(alias).release()
        for alias, run in active.items():
            await self._drive(alias, run)

    def _claim_of(self, alias: str) -> Claim:
        claim = self._claims.get(alias)
        if claim is None:
            claim = self._claims[alias] = self._claim(alias)
        return claim

    async def _drive(self, alias: str, run: Run) -> None:
        claim = self._claim_of(alias)
        token = await claim.acquire()
        if token is None:  # another replica drives it
            self.progress.pop(alias, None)
            return
        keeper = asyncio.create_task(self._keep(claim))  # a turn may outlast the lease (probes)
        try:
            await self._judge(alias, run, token)
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper

    async def _start_configured(self, plan: Plan, start: Callable[[Plan], Awaitable[None]]) -> None:
        """Start ``plan`` for the fleet if this replica holds its alias's lease (once: the
        record refuses a plan started already, whoever asks)."""
        alias = plan.alias
        if await self._claim_of(alias).acquire() is None:  # another replica starts it
            return
        fingerprint = plan_fingerprint(plan)
        try:
            await start(plan)
        except GatewayError as exc:  # it cannot be started now (a pool gone since): said once
            if fingerprint not in self._refused:
                self._refused.add(fingerprint)
                log.warning("rollout_configured_refused", alias=alias, why=exc.message)
            return
        log.info("rollout_started", alias=alias, by="configuration", fingerprint=fingerprint)

    async def _keep(self, claim: Claim) -> None:
        """Renew the lease every ``every`` seconds while a turn's work goes on."""
        while True:
            await asyncio.sleep(self._every)  # sleep-ok: the renewal period
            await claim.acquire()

    async def _judge(self, alias: str, run: Run, token: int) -> None:
        plan = run.plan
        pools = (plan.stable, plan.canary)
        counted = {
            replica: {p: f.pools.get(alias, {}).get(p, PoolCounts()) for p in pools}
            for replica, f in (await self._figures()).items()
        }
        base = baseline_doc(counted)
        if run.baseline is None:  # the step's window begins now
            await self._submit(
                alias, {"action": "window", "step": run.step, "token": token, "baseline": base}
            )
            return
        canary, stable = (window(counted, run.baseline, p) for p in (plan.canary, plan.stable))
        elapsed, paused = self._clock() - run.step_began, run.status == "paused"
        key = (alias, run.step_began)
        agreement = self._agreement.get(key)
        verdict = decide(
            plan, run.step, elapsed, canary, stable, agreement=agreement, paused=paused
        )
        # The probes, once a step, once its requests are in: not before an abort they cannot
        # prevent (another gate failed), and never to advance without them.
        wanted = plan.probes and self._probe is not None and agreement is None
        if wanted and verdict.action != "abort" and canary.requests >= plan.min_requests:
            assert self._probe is not None
            agreement = self._agreement[key] = await self._probe(plan)
            self._agreement = {
                k: v for k, v in self._agreement.items() if k[0] != alias or k == key
            }
            verdict = decide(
                plan, run.step, elapsed, canary, stable, agreement=agreement, paused=paused
            )
        look = verdict.doc()
        self.progress[alias] = {**look, "at": self._clock()}
        if verdict.action == "hold":
            return
        body: dict[str, Any] = {
            "action": verdict.action,
            "step": verdict.step,
            "token": token,
            "why": verdict.why,
            "readings": look["readings"],
        }
        if verdict.action == "advance":
            body["baseline"] = base  # the next step's window begins as it does
        await self._submit(alias, body)
        if verdict.action == "abort":
            log.warning(
                "rollout_aborted",
                alias=alias,
                step=run.step,
                share=plan.steps[run.step],
                why=verdict.why,
                gates=[r.doc() for r in verdict.breaches],
            )
            if self._on_abort is not None:
                self._on_abort(alias, verdict)
        else:
            log.info(
                "rollout_promoted" if verdict.action == "promote" else "rollout_advanced",
                alias=alias,
                step=verdict.step,
                share=plan.steps[verdict.step],
                why=verdict.why,
            )
