"""Attempts of one request racing for its client: ``predicted_latency``'s hedge.

A streamed request whose first token is late on its backend (the policy's deadline, as for
the rescue) may be sent to a second backend *without* taking it back from the first: whichever
of the two has its first bytes first takes the client, and the other is ended before anything
of it was sent (its upstream request closed, so its engine aborts it). Unlike the rescue,
nothing already waited is lost when the first backend answers soon after all.

``Race`` is the shared state: it decides who takes the client (``claim``, called by the
attempt's ``Interrupt`` as its first bytes are about to be written), ends the others, and
tells whether an attempt still has a rival running (an attempt answered "not now" defers to
it). ``HedgeBudget`` bounds the copies running at once: a copy is load, and when many streams
are late at once the fleet is short of slots, which copies would only make worse. The racing
itself (timing, picking the second backend) is in ``gateway.request.attempt``.
"""

from __future__ import annotations

from collections.abc import Callable

from backends.upstream.client import Interrupt
from gateway.request.waits import outrun


class Race:
    """Attempts racing for one client; the first to claim it answers."""

    __slots__ = ("decided", "runners", "winner")

    def __init__(self) -> None:
        self.runners: dict[Interrupt, str] = {}  # each attempt's interrupt, and its backend
        self.winner: Interrupt | None = None
        self.decided: Callable[[], None] | None = None  # called once, as the winner claims

    def join(self, backend: str) -> Interrupt:
        """The interrupt of a new attempt in the race, on ``backend``."""
        interrupt = Interrupt(self)
        self.runners[interrupt] = backend
        if self.winner is not None:  # joined too late: it has lost already
            interrupt.end(outrun(backend))
        return interrupt

    def claim(self, interrupt: Interrupt) -> bool:
        if self.winner is not None:
            return self.winner is interrupt
        self.winner = interrupt
        for other, backend in self.runners.items():
            if other is not interrupt:
                other.end(outrun(backend))
        if self.decided is not None:
            self.decided()
        return True

    def rivalled(self, interrupt: Interrupt) -> bool:
        """Whether another attempt of the race is still waiting for its first bytes."""
        if self.winner is not None:
            return False
        return any(o is not interrupt and o.armed and o.cause is None for o in self.runners)


class HedgeBudget:
    """The hedges racing now (until their race is decided: then one request is left, as
    without a hedge): at most ``share`` of the requests in flight, and at least one unless
    ``share`` is 0 (no hedge at all)."""

    __slots__ = ("running",)

    def __init__(self) -> None:
        self.running = 0

    def take(self, share: float, in_flight: int) -> Callable[[], None] | None:
        """One more hedge, if ``share`` of ``in_flight`` (the attempts on the fleet now) allows:
        the call that gives its place back (once, however often it is called); else None."""
        if share <= 0 or self.running + 1 > max(1.0, share * in_flight):
            return None
        self.running += 1
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                self.running -= 1

        return give_back
