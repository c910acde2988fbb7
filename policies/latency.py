"""How fast each backend really is: online, decaying fits of its TTFT and inter-token latency.

Every attempt teaches the ``LatencyTracker`` what its backend did with the load it had when it
was chosen (``Load``: prompt tokens it was not expected to hold in cache, requests queued in
its engine, sequences running there):

- **TTFT** (seconds from sending to the first token) is fitted per backend as
  ``base + per_ktok x uncached/1000 + per_queued x queued + per_running x running +
  per_ktok_ahead x ahead/1000``, where ``ahead`` is the prompt tokens this gateway sent the
  backend that have not produced their first token yet (``Pending``);
- **ITL** (seconds per token after the first) as ``base + per_running x running``.

Each fit is weighted least squares over its observations, each weighing
``0.5 ** (age / half-life)``, shrunk (ridge) toward the fit behind it. A backend has two: a
*recent* fit (``half_life``, 5 s), so a backend that slows down or recovers is seen within a
few seconds, shrunk toward its *long memory* (``memory``, 60 s), which keeps what is rarely
seen (how long prompts cost, say) after the recent window has forgotten it, itself shrunk
toward the *fleet's* fit (every backend's observations): where a fit has little data of its
own (a new backend, a term its traffic does not vary, a backend left without traffic) it
predicts like the fit behind it, so a backend left alone is tried again and its own figures
take over as they come. Slopes are kept non-negative: more load never predicts a faster
answer.

Solving is a 4x4 linear system per fit, done when a backend's fits have changed and their
last solution is older than ``resolve_s``: at a prediction, or (``solve_ahead``) ahead of the
predictions, in ``refresh``, which the gateway calls while it waits on backends; a prediction
is then a dot product. Each backend also
keeps the error of the predictions made when it was chosen (absolute error over observed TTFT:
its mean is the MAPE), before the observation is learned. Backends are bounded by
``max_backends`` (the oldest-seen forgotten first). Pure: the clock is passed in, nothing does
I/O.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from policies.facts import CHARS_PER_TOKEN
from policies.fit import DecayingFit
from policies.setting import check_settings, spec
from policies.types import BackendSnapshot, Outcome, RouteFacts

TTFT_TERMS: Final = ("base", "per_ktok", "per_queued", "per_running", "per_ktok_ahead")
ITL_TERMS: Final = ("base", "per_running")
# Before anything is observed: a fast engine (50 ms to a first token, 20 ms a token).
TTFT_PRIOR: Final = (0.05, 0.05, 0.05, 0.005, 0.05)
ITL_PRIOR: Final = (0.02, 0.001)
_FLOOR: Final = 1e-4  # no prediction is below 0.1 ms
DEFAULT_ANSWER_TOKENS: Final = 256.0
_TOKENS_ALPHA: Final = 0.02  # the mean answer length follows about the last 50 answers


@dataclass(frozen=True, slots=True)
class Load:
    """What was known of a backend when it was chosen: the inputs of its fits."""

    uncached: float = 0.0  # prompt tokens it was not expected to hold in cache
    queued: float = 0.0  # requests ahead in its engine's queue
    running: float = 0.0  # sequences running in its engine
    # Prompt tokens this gateway sent it that have not produced their first token yet: the
    # prefill work ahead of this one (a long prompt being prefilled delays every newcomer).
    ahead: float = 0.0

    def ttft_x(self) -> tuple[float, ...]:
        return (1.0, self.uncached / 1000.0, self.queued, self.running, self.ahead / 1000.0)

    def itl_x(self) -> tuple[float, ...]:
        return (1.0, self.running)


def load_of(
    snap: BackendSnapshot, prompt_tokens: float, cached: float = 0.0, ahead: float = 0.0
) -> Load:
    """A backend's ``Load`` from its snapshot: the engine's scraped queue plus what the gateway
    sent since that scrape; its scraped running count, else the gateway's own in-flight;
    ``ahead``: ``LatencyTracker.ahead``."""
    if snap.queue_depth is None:
        queued = 0.0
        running = float(snap.in_flight)
    else:
        queued = float(snap.queue_depth + snap.sent_since_scrape)
        running = float(snap.running if snap.running is not None else snap.in_flight)
    return Load(max(0.0, prompt_tokens - cached), queued, running, ahead)


def _ttft(c: Sequence[float], load: Load) -> float:
    # The coefficients times load.ttft_x(), written out: done once per candidate.
    t = (
        c[0]
        + c[1] * load.uncached / 1000.0
        + c[2] * load.queued
        + c[3] * load.running
        + c[4] * load.ahead / 1000.0
    )
    return t if t > _FLOOR else _FLOOR


def _itl(c: Sequence[float], load: Load) -> float:
    t = c[0] + c[1] * load.running
    return t if t > _FLOOR else _FLOOR


@dataclass(frozen=True, slots=True)
class LatencyConfig:
    half_life: float = field(
        default=5.0,
        metadata=spec(
            "seconds for an observation's weight to halve: how fast a backend that slows down or "
            "recovers is seen",
            gt=0,
        ),
    )
    memory: float = 60.0  # the same, for the long-memory fit (what is rarely seen)
    # pseudo-observations pulling a fit toward the one behind it
    ridge: float = field(
        default=2.0, metadata=spec("observations' worth of pull toward the fleet's figures", gt=0)
    )
    resolve_s: float = 0.25  # a changed fit is solved again at most this often
    max_backends: int = 4096

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.resolve_s >= 0:
            raise ValueError("resolve_s must be at least 0")
        if not self.memory >= self.half_life:
            raise ValueError("memory must be at least half_life")
        if self.max_backends < 1:
            raise ValueError("max_backends must be at least 1")


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft: float  # seconds to the first token
    itl: float  # seconds per token after it


@dataclass(slots=True)
class _Fits:
    """A TTFT fit and an ITL fit over the same observations, and their last solution."""

    ttft: DecayingFit = field(default_factory=lambda: DecayingFit(len(TTFT_TERMS)))
    itl: DecayingFit = field(default_factory=lambda: DecayingFit(len(ITL_TERMS)))
    ttft_coef: tuple[float, ...] = TTFT_PRIOR
    itl_coef: tuple[float, ...] = ITL_PRIOR

    def add(self, load: Load, ttft: float, itl: float | None, now: float, half_life: float) -> None:
        self.ttft.add(load.ttft_x(), ttft, now, half_life)
        if itl is not None:
            self.itl.add(load.itl_x(), itl, now, half_life)

    def solve(self, prior: _Fits | None, ridge: float, now: float, half_life: float) -> None:
        self.ttft.decay(now, half_life)
        self.itl.decay(now, half_life)
        self.ttft_coef = self.ttft.solve(prior.ttft_coef if prior else TTFT_PRIOR, ridge)
        self.itl_coef = self.itl.solve(prior.itl_coef if prior else ITL_PRIOR, ridge)


@dataclass(slots=True)
class _Model:
    """A backend's fits: ``recent`` (``half_life``) shrunk toward ``memory`` (``memory``),
    itself shrunk toward the fleet's; and what its predictions' errors were."""

    recent: _Fits = field(default_factory=_Fits)
    memory: _Fits = field(default_factory=_Fits)
    solved_at: float = -math.inf
    dirty: bool = True  # observed (or the fleet moved) since the last solve
    # Prediction error of TTFT, for predictions made when the backend was chosen.
    ape_sum: float = 0.0
    ape_n: int = 0
    observed: int = 0
    last_ttft: float | None = None


@dataclass(frozen=True, slots=True)
class BackendLatency:
    """What the tracker knows of one backend, for metrics, the admin API and ``top``."""

    backend: str
    ttft: dict[str, float]  # the fit's coefficients by term
    itl: dict[str, float]
    weight: float  # the decayed sum of recent observations behind its own fit
    observed: int
    ape_sum: float
    ape_n: int
    last_ttft: float | None
    idle_ttft: float  # predicted TTFT of a 256-token prompt on the backend as loaded now
    itl_now: float

    @property
    def mape(self) -> float | None:
        return self.ape_sum / self.ape_n if self.ape_n else None


class Pending:
    """One attempt's prompt, ahead of newcomers on its backend until its first token."""

    __slots__ = ("_open", "_tracker", "backend", "tokens")

    def __init__(self, tracker: LatencyTracker, backend: str, tokens: float) -> None:
        self._tracker = tracker
        self.backend = backend
        self.tokens = tokens
        self._open = True

    def done(self) -> None:
        """Its first token came (or the attempt ended): idempotent."""
        if self._open:
            self._open = False
            self._tracker._settle(self.backend, self.tokens)


IDLE_PROMPT: Final = 256.0  # the prompt size of the "TTFT now" figure shown per backend


class LatencyTracker:
    """Per-backend TTFT and ITL fits, learned from every attempt's outcome."""

    def __init__(
        self,
        config: LatencyConfig | None = None,
        clock: Callable[[], float] | None = None,
        *,
        solve_ahead: bool = False,
    ) -> None:
        self.config = config or LatencyConfig()
        self.clock = clock or time.monotonic
        self.fleet = _Fits()  # every backend's observations, with the long memory
        self._fleet_solved_at = -math.inf
        self._fleet_dirty = True
        self._models: OrderedDict[str, _Model] = OrderedDict()
        self._pending: dict[str, float] = {}  # backend -> prompt tokens awaiting a first token
        # The mean answer length lately (tokens), for answers that give no max_tokens.
        self.mean_tokens = DEFAULT_ANSWER_TOKENS
        # Set by a caller that calls ``refresh`` while it waits on backends (``want_refresh``):
        # a prediction then solves only fits past the age limit, and uses the last solution
        # otherwise, however many observations came since.
        self.solve_ahead = solve_ahead
        self._refresh_pending = False

    def configure(self, config: LatencyConfig) -> None:
        """New half-lives and ridge (live); what was learned is kept."""
        self.config = config
        self._fleet_dirty = True
        for m in self._models.values():
            m.dirty = True
        while len(self._models) > config.max_backends:
            self._models.popitem(last=False)

    def backends(self) -> list[str]:
        return list(self._models)

    def weight(self, backend: str, now: float | None = None) -> float:
        """The recent observations behind ``backend``'s own fit, each counted as it has faded
        (0 for a backend never observed)."""
        m = self._models.get(backend)
        if m is None:
            return 0.0
        fit = m.recent.ttft
        age = max(0.0, (self.clock() if now is None else now) - fit.at)
        faded: float = 0.5 ** (age / self.config.half_life)
        return fit.weight * faded

    def load(self, snap: BackendSnapshot, prompt_tokens: float, cached: float = 0.0) -> Load:
        """``snap``'s backend's load for a prompt of ``prompt_tokens`` (``cached`` of them
        expected in its cache), with what this gateway has pending on it (``ahead``)."""
        return load_of(snap, prompt_tokens, cached, self.ahead(snap.id))

    def ahead(self, backend: str) -> float:
        """Prompt tokens sent to ``backend`` that await their first token (``begin``)."""
        return self._pending.get(backend, 0.0)

    def begin(self, backend: str, tokens: float) -> Pending:
        """``tokens`` prompt tokens are sent to ``backend``: they are ahead of any newcomer
        until ``Pending.done`` (its first token, or the attempt's end)."""
        self._pending[backend] = self._pending.get(backend, 0.0) + tokens
        return Pending(self, backend, tokens)

    def _settle(self, backend: str, tokens: float) -> None:
        left = self._pending.get(backend, 0.0) - tokens
        if left > 0.5:
            self._pending[backend] = left
        else:
            self._pending.pop(backend, None)

    def forget(self, backend: str) -> None:
        self._models.pop(backend, None)

    # -- predictions ------------------------------------------------------------------------

    def predict(self, backend: str, load: Load) -> Prediction:
        f = self._coefs(backend)
        return Prediction(_ttft(f.ttft_coef, load), _itl(f.itl_coef, load))

    def want_refresh(self) -> bool:
        """Whether the caller should schedule a ``refresh`` now (one at a time)."""
        if self._refresh_pending:
            return False
        self._refresh_pending = True
        return True

    def refresh(self, now: float | None = None) -> None:
        """Solve ahead of the predictions (``solve_ahead``): the fits that changed and whose
        solution is older than ``resolve_s``, and the others half way to the age limit, so
        that a prediction is a dot product. Solving at the prediction put up to six solves
        before the request's send when requests were sparse."""
        self._refresh_pending = False
        if now is None:
            now = self.clock()
        if self._ahead_due(self._fleet_solved_at, self._fleet_dirty, now):
            self._solve_fleet(now)
        for m in self._models.values():
            if self._ahead_due(m.solved_at, m.dirty, now):
                self._solve(m, now)

    def weigh(self, backend: str, load: Load, now: float) -> tuple[float, float, float]:
        """What a decision weighs per candidate, at ``now`` (one clock read per decision):
        the predicted TTFT, the predicted ITL, and the recent observations behind it."""
        f = self._coefs(backend, now)
        return _ttft(f.ttft_coef, load), _itl(f.itl_coef, load), self.weight(backend, now)

    def _age_limit(self) -> float:
        # Data grows old even without new observations: solve now and then anyway, so that a
        # backend left alone drifts back to its long memory and then to the fleet's figures.
        return max(self.config.resolve_s, self.config.half_life / 4)

    def _due(self, solved_at: float, dirty: bool, now: float) -> bool:
        """At a prediction."""
        age = now - solved_at
        if age >= self._age_limit():
            return True
        return dirty and age >= self.config.resolve_s and not self.solve_ahead

    def _ahead_due(self, solved_at: float, dirty: bool, now: float) -> bool:
        """At a ``refresh``."""
        age = now - solved_at
        return (dirty and age >= self.config.resolve_s) or age >= self._age_limit() / 2

    def _coefs(self, backend: str, now: float | None = None) -> _Fits:
        if now is None:
            now = self.clock()
        if self._due(self._fleet_solved_at, self._fleet_dirty, now):
            self._solve_fleet(now)
        m = self._models.get(backend)
        if m is None:
            return self.fleet
        if self._due(m.solved_at, m.dirty, now):
            self._solve(m, now)
        return m.recent

    def _solve_fleet(self, now: float) -> None:
        cfg = self.config
        self.fleet.solve(None, cfg.ridge / 4, now, cfg.memory)  # lightly held by the prior
        self._fleet_solved_at, self._fleet_dirty = now, False

    def _solve(self, m: _Model, now: float) -> None:
        cfg = self.config
        m.memory.solve(self.fleet, cfg.ridge, now, cfg.memory)
        m.recent.solve(m.memory, cfg.ridge, now, cfg.half_life)
        m.solved_at, m.dirty = now, False

    # -- learning ---------------------------------------------------------------------------

    def observe(
        self, backend: str, load: Load, outcome: Outcome, predicted: Prediction | None = None
    ) -> None:
        """Learn from one attempt chosen under ``load``; ``predicted``: what was predicted then.

        TTFT is learned from every attempt that produced a first token; ITL from a whole
        stream of two tokens or more. Anything else (a failure before the first token, a
        backend that refused) teaches nothing here: health and circuits handle those.
        """
        ttft = outcome.first_token_s
        if ttft is None or ttft < 0 or not math.isfinite(ttft):
            return
        now = self.clock()
        cfg = self.config
        m = self._models.get(backend)
        if m is None:
            m = self._models[backend] = _Model()
            if len(self._models) > cfg.max_backends:
                self._models.popitem(last=False)
        m.observed += 1
        m.last_ttft = ttft
        if predicted is not None and ttft > 0:
            m.ape_sum += abs(predicted.ttft - ttft) / ttft
            m.ape_n += 1
        tokens = outcome.tokens
        if outcome.ok and tokens is not None and tokens > 0:
            self.mean_tokens += _TOKENS_ALPHA * (tokens - self.mean_tokens)
        itl = None
        if outcome.ok and tokens is not None and tokens >= 2 and outcome.duration_s > ttft:
            itl = (outcome.duration_s - ttft) / (tokens - 1)
        m.recent.add(load, ttft, itl, now, cfg.half_life)
        m.memory.add(load, ttft, itl, now, cfg.memory)
        self.fleet.add(load, ttft, itl, now, cfg.memory)
        m.dirty = self._fleet_dirty = True

    # -- what is shown ----------------------------------------------------------------------

    def view(self, backend: str, now_load: Load | None = None) -> BackendLatency:
        f = self._coefs(backend)
        own = self._models.get(backend)
        load = now_load or Load()
        probe = Load(IDLE_PROMPT, load.queued, load.running, load.ahead)
        p = self.predict(backend, probe)
        return BackendLatency(
            backend=backend,
            ttft=dict(zip(TTFT_TERMS, f.ttft_coef, strict=True)),
            itl=dict(zip(ITL_TERMS, f.itl_coef, strict=True)),
            weight=own.recent.ttft.weight if own else 0.0,
            observed=own.observed if own else 0,
            ape_sum=own.ape_sum if own else 0.0,
            ape_n=own.ape_n if own else 0,
            last_ttft=own.last_ttft if own else None,
            idle_ttft=p.ttft,
            itl_now=p.itl,
        )


def prompt_size(facts: RouteFacts) -> float:
    """The prompt's size in tokens: exact when the facts carry its token ids, else estimated
    from its characters (``RouteFacts.prompt_chars``, about four to a token)."""
    if facts.prompt_tokens is not None:
        return float(len(facts.prompt_tokens))
    return facts.prompt_chars / CHARS_PER_TOKEN
