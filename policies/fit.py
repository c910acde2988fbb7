"""Weighted least squares whose observations fade: the fits behind ``policies.latency``.

Pure arithmetic on lists (no numpy: the systems are 2x2 to 5x5, solved at most every
``resolve_s`` per backend), with non-negative slopes and a ridge pull toward a prior.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

_MIN_SCALE: Final = 1e-6  # the least mean square a term's pull toward the prior assumes


class DecayingFit:
    """Weighted least squares whose observations' weights halve every ``half_life`` seconds.

    The sums are kept in the units of a base time: an observation made ``t`` seconds
    after it is added with weight 2^(t / half_life), and the sums are brought to the present
    (``decay``) only when read or when those weights grow large. Adding costs no pass over
    the sums to age them.
    """

    __slots__ = ("_base", "_half_life", "_last", "_weight", "n", "xtx", "xty")

    # Weights beyond 2^_REBASE are brought back to 1 (a float's exponent ends at 2^1023).
    _REBASE: Final = 40.0

    def __init__(self, dims: int) -> None:
        self.xtx = [[0.0] * dims for _ in range(dims)]
        self.xty = [0.0] * dims
        self._weight = 0.0  # the sum of the observations' weights, in the units of ``at``
        self._base = 0.0  # the base time of the sums' units
        self._last = 0.0  # the latest time seen: the present, for the weights
        self._half_life = 0.0  # what the sums' units assume (0: nothing yet)
        self.n = 0  # observations ever added

    @property
    def at(self) -> float:
        """The latest time seen (of an observation, or brought to by ``decay``)."""
        return self._last

    @property
    def weight(self) -> float:
        """The sum of the observations' weights at the latest time seen."""
        if self._half_life <= 0.0 or self._last <= self._base:
            return self._weight
        age: float = 0.5 ** ((self._last - self._base) / self._half_life)
        return self._weight * age

    def decay(self, now: float, half_life: float) -> None:
        """Bring the sums to the present (``now``, or the latest time seen if later)."""
        self._units(half_life)
        self._last = max(self._last, now)
        self._rebase(self._last, half_life)

    def add(self, x: Sequence[float], y: float, now: float, half_life: float) -> None:
        self._units(half_life)
        self._last = max(self._last, now)
        age = (self._last - self._base) / half_life  # in half-lives
        if age > self._REBASE or self._weight == 0.0:
            self._rebase(self._last, half_life)  # (an empty fit only moves its base)
            g = 1.0
        else:
            g = 2.0**age
        for i, xi in enumerate(x):
            if xi:
                gx = g * xi
                row = self.xtx[i]
                for j, xj in enumerate(x):
                    row[j] += gx * xj
                self.xty[i] += gx * y
        self._weight += g
        self.n += 1

    def _units(self, half_life: float) -> None:
        """Use ``half_life`` from the latest time seen on (the time before it aged at the one
        before)."""
        if half_life != self._half_life:
            if self._half_life > 0.0:
                self._rebase(self._last, self._half_life)
            self._half_life = half_life

    def _rebase(self, to: float, half_life: float) -> None:
        """The sums in the units of ``to``."""
        if to > self._base and self._weight != 0.0:
            f = 0.5 ** ((to - self._base) / half_life)
            if f < 1.0:
                for row in self.xtx:
                    for j in range(len(row)):
                        row[j] *= f
                for j in range(len(self.xty)):
                    self.xty[j] *= f
                self._weight *= f
        self._base = max(self._base, to)

    def solve(self, prior: Sequence[float], ridge: float) -> tuple[float, ...]:
        """The coefficients minimising the weighted squared error plus the squared distance
        to ``prior`` of ``ridge`` pseudo-observations; slopes (all but the first) clamped at
        zero.

        A pseudo-observation has each term at its typical size in the data (its mean square),
        so the pull toward the prior does not depend on the units of a term: a term with
        large values (sequences running) is not learned from a handful of old observations
        any more than one with small values is. A term the data never varies keeps the
        prior's coefficient.
        """
        if self._half_life > 0.0:
            self._rebase(self._last, self._half_life)  # the sums in the present's units
        d = len(prior)
        w = self._weight
        pull = [ridge * max(self.xtx[i][i] / w if w > 1e-12 else 1.0, _MIN_SCALE) for i in range(d)]
        a = [[self.xtx[i][j] + (pull[i] if i == j else 0.0) for j in range(d)] for i in range(d)]
        b = [self.xty[i] + pull[i] * prior[i] for i in range(d)]
        # Non-negative slopes by active set: a slope the solution makes negative is fixed at
        # zero and the others solved again without it (at most once per term), so the rest of
        # the fit, the intercept above all, accounts for the data by itself.
        free = list(range(d))
        while True:
            sub = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])
            if sub is None:
                return tuple(prior)
            coef = [0.0] * d
            for i, c in zip(free, sub, strict=True):
                coef[i] = c
            negative = [i for i in free[1:] if coef[i] < 0.0]
            if not negative:
                return tuple(coef)
            worst = min(negative, key=lambda i: coef[i])
            free.remove(worst)


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
