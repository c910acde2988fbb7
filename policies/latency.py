"""How fast each backend really is: online, decaying fits of its TTFT and inter-token latency.

Every attempt teaches the ``LatencyTracker`` what its backend did with the load it had when it
was chosen (``Load``: prompt tokens it was not expected to hold in cache, requests queued in
its engine, sequences running there):

- **TTFT** (seconds from sending to the first token) is fitted per backend as
  ``base + per_ktok x uncached/1000 + per_queued x queued + per_running x running``;
- **ITL** (seconds per token after the first) as ``base + per_running x running``.

Each fit is weighted least squares over all its observations, each weighing
``0.5 ** (age / half_life)``, so a backend that slows down or recovers is seen within a few
half-lives, and shrunk (ridge) toward the *fleet's* fit: a backend with few recent
observations (a new one, or one that got no traffic for a while) is predicted like the fleet,
so it is tried again and its own figures take over as they come. Slopes are kept
non-negative: more load never predicts a faster answer.

Solving is a 4x4 linear system, done when a backend's fit has changed and its last solution
is older than ``resolve_s``; a prediction is a dot product. Each backend also keeps the error
of the predictions made when it was chosen (absolute error over observed TTFT: its mean is the
MAPE), before the observation is learned. Backends are bounded by ``max_backends`` (the
oldest-seen forgotten first). Pure: the clock is passed in, nothing does I/O.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from policies.facts import CHARS_PER_TOKEN
from policies.types import BackendSnapshot, Outcome, RouteFacts

TTFT_TERMS: Final = ("base", "per_ktok", "per_queued", "per_running")
ITL_TERMS: Final = ("base", "per_running")
# Before anything is observed: a fast engine (50 ms to a first token, 20 ms a token).
TTFT_PRIOR: Final = (0.05, 0.05, 0.05, 0.005)
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

    def ttft_x(self) -> tuple[float, ...]:
        return (1.0, self.uncached / 1000.0, self.queued, self.running)

    def itl_x(self) -> tuple[float, ...]:
        return (1.0, self.running)


def load_of(snap: BackendSnapshot, prompt_tokens: float, cached: float = 0.0) -> Load:
    """A backend's ``Load`` from its snapshot: the engine's scraped queue plus what the gateway
    sent since that scrape; its scraped running count, else the gateway's own in-flight."""
    if snap.queue_depth is None:
        queued = 0.0
        running = float(snap.in_flight)
    else:
        queued = float(snap.queue_depth + snap.sent_since_scrape)
        running = float(snap.running if snap.running is not None else snap.in_flight)
    return Load(max(0.0, prompt_tokens - cached), queued, running)


def dot(coef: Sequence[float], x: Sequence[float]) -> float:
    return sum(c * v for c, v in zip(coef, x, strict=True))


class DecayingFit:
    """Weighted least squares whose observations' weights halve every ``half_life`` seconds."""

    __slots__ = ("at", "n", "weight", "xtx", "xty")

    def __init__(self, dims: int) -> None:
        self.xtx = [[0.0] * dims for _ in range(dims)]
        self.xty = [0.0] * dims
        self.weight = 0.0  # the sum of the observations' weights now
        self.at = 0.0  # when the weights were last decayed
        self.n = 0  # observations ever added

    def decay(self, now: float, half_life: float) -> None:
        if now <= self.at:
            return
        f = 0.5 ** ((now - self.at) / half_life)
        self.at = now
        if f >= 1.0 or self.weight == 0.0:
            return
        for row in self.xtx:
            for j in range(len(row)):
                row[j] *= f
        for j in range(len(self.xty)):
            self.xty[j] *= f
        self.weight *= f

    def add(self, x: Sequence[float], y: float, now: float, half_life: float) -> None:
        self.decay(now, half_life)
        for i, xi in enumerate(x):
            row = self.xtx[i]
            for j, xj in enumerate(x):
                row[j] += xi * xj
            self.xty[i] += xi * y
        self.weight += 1.0
        self.n += 1

    def solve(self, prior: Sequence[float], ridge: float) -> tuple[float, ...]:
        """The coefficients minimising the weighted squared error plus ``ridge`` x the squared
        distance to ``prior``; slopes (all but the first) clamped at zero."""
        d = len(prior)
        a = [[self.xtx[i][j] + (ridge if i == j else 0.0) for j in range(d)] for i in range(d)]
        b = [self.xty[i] + ridge * prior[i] for i in range(d)]
        coef = _solve(a, b)
        if coef is None:
            return tuple(prior)
        out = [coef[0], *(max(0.0, c) for c in coef[1:])]
        return tuple(out)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular. ``a`` and ``b`` are
    overwritten."""
    n = len(b)
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-12:
            return None
        if piv != col:
            a[col], a[piv] = a[piv], a[col]
            b[col], b[piv] = b[piv], b[col]
        inv = 1.0 / a[col][col]
        for r in range(col + 1, n):
            f = a[r][col] * inv
            if f:
                row, top = a[r], a[col]
                for c in range(col, n):
                    row[c] -= f * top[c]
                b[r] -= f * b[col]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        s = b[r] - sum(a[r][c] * x[c] for c in range(r + 1, n))
        x[r] = s / a[r][r]
    return x if all(math.isfinite(v) for v in x) else None


@dataclass(frozen=True, slots=True)
class LatencyConfig:
    half_life: float = 5.0  # seconds for an observation's weight to halve
    ridge: float = 2.0  # pseudo-observations pulling a backend's fit toward the fleet's
    resolve_s: float = 0.25  # a changed fit is solved again at most this often
    max_backends: int = 4096

    def __post_init__(self) -> None:
        if not (self.half_life > 0 and self.ridge > 0 and self.resolve_s >= 0):
            raise ValueError("half_life and ridge must be positive, resolve_s not negative")
        if self.max_backends < 1:
            raise ValueError("max_backends must be at least 1")


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft: float  # seconds to the first token
    itl: float  # seconds per token after it

    def e2e(self, tokens: float) -> float:
        """Seconds to the whole answer of ``tokens`` tokens."""
        return self.ttft + self.itl * max(0.0, tokens - 1.0)


@dataclass(slots=True)
class _Model:
    """One fit (a backend's, or the fleet's) and its cached solution."""

    ttft: DecayingFit = field(default_factory=lambda: DecayingFit(len(TTFT_TERMS)))
    itl: DecayingFit = field(default_factory=lambda: DecayingFit(len(ITL_TERMS)))
    ttft_coef: tuple[float, ...] = TTFT_PRIOR
    itl_coef: tuple[float, ...] = ITL_PRIOR
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


IDLE_PROMPT: Final = 256.0  # the prompt size of the "TTFT now" figure shown per backend


class LatencyTracker:
    """Per-backend TTFT and ITL fits, learned from every attempt's outcome."""

    def __init__(
        self, config: LatencyConfig | None = None, clock: Callable[[], float] | None = None
    ) -> None:
        self.config = config or LatencyConfig()
        self.clock = clock or time.monotonic
        self.fleet = _Model()
        self._models: OrderedDict[str, _Model] = OrderedDict()
        # The mean answer length lately (tokens), for answers that give no max_tokens.
        self.mean_tokens = DEFAULT_ANSWER_TOKENS

    def configure(self, config: LatencyConfig) -> None:
        """New half-life and ridge (live); what was learned is kept."""
        self.config = config
        for m in (self.fleet, *self._models.values()):
            m.dirty = True
        while len(self._models) > config.max_backends:
            self._models.popitem(last=False)

    def backends(self) -> list[str]:
        return list(self._models)

    def forget(self, backend: str) -> None:
        self._models.pop(backend, None)

    # -- predictions ------------------------------------------------------------------------

    def predict(self, backend: str, load: Load) -> Prediction:
        m = self._coefs(backend)
        return Prediction(
            max(_FLOOR, dot(m.ttft_coef, load.ttft_x())), max(_FLOOR, dot(m.itl_coef, load.itl_x()))
        )

    def _coefs(self, backend: str) -> _Model:
        now = self.clock()
        fleet = self._solved(self.fleet, None, now)
        m = self._models.get(backend)
        if m is None:
            return fleet
        return self._solved(m, fleet, now)

    def _solved(self, m: _Model, prior: _Model | None, now: float) -> _Model:
        cfg = self.config
        # Data grows old even without new observations: re-solve now and then so that a
        # backend left alone drifts back to the fleet's figures.
        stale = now - m.solved_at >= max(cfg.resolve_s, cfg.half_life / 4)
        if (m.dirty and now - m.solved_at >= cfg.resolve_s) or stale:
            m.ttft.decay(now, cfg.half_life)
            m.itl.decay(now, cfg.half_life)
            if prior is None:  # the fleet: shrunk toward the built-in prior, lightly
                m.ttft_coef = m.ttft.solve(TTFT_PRIOR, cfg.ridge / 4)
                m.itl_coef = m.itl.solve(ITL_PRIOR, cfg.ridge / 4)
            else:
                m.ttft_coef = m.ttft.solve(prior.ttft_coef, cfg.ridge)
                m.itl_coef = m.itl.solve(prior.itl_coef, cfg.ridge)
            m.solved_at = now
            m.dirty = False
        return m

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
        for fit in (m.ttft, self.fleet.ttft):
            fit.add(load.ttft_x(), ttft, now, cfg.half_life)
        tokens = outcome.tokens
        if outcome.ok and tokens is not None and tokens > 0:
            self.mean_tokens += _TOKENS_ALPHA * (tokens - self.mean_tokens)
        if outcome.ok and tokens is not None and tokens >= 2 and outcome.duration_s > ttft:
            itl = (outcome.duration_s - ttft) / (tokens - 1)
            for fit in (m.itl, self.fleet.itl):
                fit.add(load.itl_x(), itl, now, cfg.half_life)
        m.dirty = self.fleet.dirty = True

    # -- what is shown ----------------------------------------------------------------------

    def view(self, backend: str, now_load: Load | None = None) -> BackendLatency:
        m = self._coefs(backend)
        own = self._models.get(backend)
        load = now_load or Load()
        probe = Load(IDLE_PROMPT, load.queued, load.running)
        p = self.predict(backend, probe)
        return BackendLatency(
            backend=backend,
            ttft=dict(zip(TTFT_TERMS, m.ttft_coef, strict=True)),
            itl=dict(zip(ITL_TERMS, m.itl_coef, strict=True)),
            weight=own.ttft.weight if own else 0.0,
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
