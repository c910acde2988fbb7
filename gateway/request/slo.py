"""A request's own TTFT objective: wait for a backend predicted to meet it, or be shed.

A request may state the time to first token it needs (``[latency] slo_header``, e.g.
``x-ttft-slo-ms: 500``). Before it is sent, the latency tracker predicts its TTFT on each
candidate backend; when one is predicted to meet the objective, it goes on (``met``). When
none is:

- without the admission queue, it goes on anyway (``unmet``): the gateway does not refuse
  work it has room for on a prediction;
- with the admission queue, it waits (up to the queue's ``max_wait``) for the fleet to
  change (a request ending, a scrape, a backend back) until one is predicted to meet it
  (``waited``); if none is by then, a request of priority above 0 goes on late
  (``late``) and one of priority 0 is shed with a 503 ``slo_unmeetable`` (``shed``), so
  that the work done is work somebody still wants.

Every outcome is counted (``llm_gateway_slo_requests_total{outcome}``).
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Final, Protocol

from backends.errors import AdmissionRejected, InvalidRequest, NoBackendAvailable
from gateway.request.router import Step
from policies.latency import prompt_size

if TYPE_CHECKING:
    from gateway.config.settings import Settings
    from gateway.limits.admission import AdmissionQueue
    from gateway.observe.metrics import GatewayMetrics
    from gateway.request.router import Router
    from policies.latency import LatencyTracker

OUTCOMES: Final = ("met", "unmet", "waited", "late", "shed")
_MAX_SLO_MS: Final = 3_600_000.0


class SloUnmeetable(AdmissionRejected):
    default_code = "slo_unmeetable"


class ChangeSignal:
    """Wakes every waiter when the fleet's capacity may have changed (``BackendPool.on_change``)."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future[None]] = set()

    def notify(self) -> None:
        for f in self._waiters:
            if not f.done():
                f.set_result(None)
        self._waiters.clear()

    async def wait(self) -> None:
        """Return at the next change (the caller bounds the wait)."""
        f: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(f)
        try:
            await f
        finally:
            self._waiters.discard(f)


def parse_slo(value: str | None) -> float | None:
    """The objective in seconds, from the header's milliseconds; None when not given."""
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not 0 < ms <= _MAX_SLO_MS:  # NaN too
        raise InvalidRequest(
            f"The TTFT objective must be a number of milliseconds in (0, {_MAX_SLO_MS:.0f}], "
            f"got {value[:40]!r}.",
            param="header",
        )
    return ms / 1000.0


class SloServices(Protocol):
    """What the SLO check reads of the request path's services (``Services`` is one)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def router(self) -> Router: ...

    @property
    def latency(self) -> LatencyTracker: ...

    @property
    def metrics(self) -> GatewayMetrics: ...

    @property
    def admission(self) -> AdmissionQueue | None: ...

    @property
    def changes(self) -> ChangeSignal: ...


def best_predicted(svc: SloServices, step: Step) -> float | None:
    """The lowest TTFT the tracker predicts for ``step``'s request among its candidates now
    (None when no backend can take it: the attempt loop says so)."""
    router, tracker = svc.router, svc.latency
    try:
        candidates = router.pool.candidates(step.facts.model, role=step.role, only=step.only)
    except NoBackendAvailable:
        return None
    size = prompt_size(step.facts)
    return min(tracker.predict(c.id, tracker.load(c, size)).ttft for c in candidates)


async def meet_slo(svc: SloServices, step: Step, slo: float, priority: int) -> str:
    """Return once the request may go on (and how it was decided); raises ``SloUnmeetable``."""
    outcome = await _decide(svc, step, slo, priority)
    svc.metrics.slo_requests.labels(outcome).inc()
    if outcome == "shed":
        settings = svc.settings.limits.admission
        raise SloUnmeetable(
            f"No backend is predicted to give a first token within {slo * 1000:g} ms, and "
            f"none was within {settings.max_wait:g} s; please retry shortly.",
            retry_after=settings.retry_after,
        )
    return outcome


async def _decide(svc: SloServices, step: Step, slo: float, priority: int) -> str:
    best = best_predicted(svc, step)
    if best is None or best <= slo:
        return "met"
    if svc.admission is None:
        return "unmet"
    try:
        async with asyncio.timeout(svc.settings.limits.admission.max_wait):
            while True:
                await svc.changes.wait()
                best = best_predicted(svc, step)
                if best is None or best <= slo:
                    return "waited"
    except TimeoutError:
        return "late" if priority > 0 else "shed"
