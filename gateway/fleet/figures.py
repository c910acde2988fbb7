"""A replica's figures for the fleet, and the fleet's: their sums over the replicas.

Each replica puts in its report (``gateway.fleet.registry.Report``) what it served since it
started, read from the counters the gateway keeps anyway (``GatewayMetrics``, the limiter's
rejections) when the report is made, every ``fleet.report_interval`` s: nothing is added to
the request path. Every figure is a cumulative count, so the replicas' figures add up:

- ``requests`` and ``errors`` (answered 5xx);
- ``ttft``: time to first token as cumulative histogram buckets, ``(upper bound, count)``,
  the last bound +inf: a fleet quantile is computed from the summed buckets (``quantile``);
- ``rejections``: requests refused by a limit or a budget, per API key;
- ``canary``: requests per alias per pool (the canary split);
- ``pools``: per alias per pool (those of ``canary``), the requests, errors, TTFT and ITL
  buckets a rollout's gates compare (``gateway.rollouts.gates``);
- ``decisions``: requests routed per backend (the last one tried).

A report stays small whatever clients send: each breakdown keeps its largest entries and folds
the rest into ``(other)`` (a name no API key can have), names cut at 72 characters. Pure:
metric families and counts in, figures out; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client.core import Metric

OTHER: Final = "(other)"
MAX_KEYS: Final = 20  # rejections: the keys refused most
MAX_BACKENDS: Final = 24  # decisions
MAX_ALIASES: Final = 6  # canary: aliases, each with ...
MAX_POOLS: Final = 4  # ... its pools
NAME_CHARS: Final = 72  # an API key's id: "key:" and a name of at most 64

# The metrics read (``gateway.observe.metrics.GatewayMetrics``), by sample name.
REQUESTS_SAMPLE: Final = "llm_gateway_requests_total"
TTFT_SAMPLE: Final = "llm_gateway_time_to_first_token_seconds_bucket"
POOL_REQUESTS_SAMPLE: Final = "llm_gateway_pool_requests_total"
POOL_ERRORS_SAMPLE: Final = "llm_gateway_pool_errors_total"
POOL_TTFT_SAMPLE: Final = "llm_gateway_pool_time_to_first_token_seconds_bucket"
POOL_ITL_SAMPLE: Final = "llm_gateway_pool_inter_token_latency_seconds_bucket"
_UNROUTED: Final = "none"  # the backend label of a request that reached none

Bucket = tuple[float, int]  # (upper bound, cumulative count)


@dataclass(frozen=True, slots=True)
class PoolCounts:
    """One pool's cumulative counts for an alias: requests answered, errors among them, and
    time to first token and inter-token latency as cumulative histogram buckets."""

    requests: int = 0
    errors: int = 0
    ttft: tuple[Bucket, ...] = ()
    itl: tuple[Bucket, ...] = ()

    def since(self, then: PoolCounts) -> PoolCounts:
        """What was counted after ``then``, an earlier reading of the same replica: the
        window's counts. Counts that went back (the replica restarted, its counters with it)
        are all the window's."""
        if self.requests < then.requests:
            return self
        return PoolCounts(
            requests=max(self.requests - then.requests, 0),
            errors=max(self.errors - then.errors, 0),
            ttft=_buckets_since(self.ttft, then.ttft),
            itl=_buckets_since(self.itl, then.itl),
        )

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    def doc(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "ttft": _buckets_doc(self.ttft),
            "itl": _buckets_doc(self.itl),
        }

    @classmethod
    def parse(cls, doc: Any) -> PoolCounts:
        return cls(
            requests=int(doc.get("requests", 0)),
            errors=int(doc.get("errors", 0)),
            ttft=_buckets_parse(doc.get("ttft", [])),
            itl=_buckets_parse(doc.get("itl", [])),
        )


def _buckets_since(now: Sequence[Bucket], then: Sequence[Bucket]) -> tuple[Bucket, ...]:
    bounds = sorted({le for le, _ in now} | {le for le, _ in then})
    out: list[Bucket] = []
    floor = 0
    for le, n_now, n_then in zip(bounds, _at(now, bounds), _at(then, bounds), strict=True):
        floor = max(floor, n_now - n_then, 0)  # cumulative: never decreasing
        out.append((le, floor))
    return tuple(out)


def _at(buckets: Sequence[Bucket], bounds: Sequence[float]) -> list[int]:
    """The count at each of ``bounds`` (ascending): that of the largest bound at or below it
    in ``buckets``, as a missing bound is read."""
    out, i, below = [], 0, 0
    for le in bounds:
        while i < len(buckets) and buckets[i][0] <= le:
            below = buckets[i][1]
            i += 1
        out.append(below)
    return out


def _buckets_doc(buckets: Sequence[Bucket]) -> list[list[Any]]:
    """As JSON has them: the +inf bound is null."""
    return [[None if math.isinf(le) else le, n] for le, n in buckets]


def _buckets_parse(doc: Any) -> tuple[Bucket, ...]:
    return tuple((math.inf if le is None else float(le), int(n)) for le, n in doc)


PoolFigures = dict[str, dict[str, PoolCounts]]  # alias -> pool -> counts


@dataclass(frozen=True, slots=True)
class Figures:
    """What one replica (or, summed, the fleet) served: cumulative counts."""

    requests: int = 0
    errors: int = 0
    ttft: tuple[Bucket, ...] = ()  # by bound, ascending; the last bound +inf
    rejections: dict[str, int] = field(default_factory=dict)  # per API key
    canary: dict[str, dict[str, int]] = field(default_factory=dict)  # alias -> pool -> n
    decisions: dict[str, int] = field(default_factory=dict)  # per backend
    pools: PoolFigures = field(default_factory=dict)

    def doc(self) -> dict[str, Any]:
        """As JSON has it: the +inf bound is null."""
        return {
            "requests": self.requests,
            "errors": self.errors,
            "ttft": _buckets_doc(self.ttft),
            "rejections": dict(self.rejections),
            "canary": {alias: dict(pools) for alias, pools in self.canary.items()},
            "decisions": dict(self.decisions),
            "pools": {
                alias: {pool: c.doc() for pool, c in pools.items()}
                for alias, pools in self.pools.items()
            },
        }

    def view(self) -> dict[str, Any]:
        """``doc`` with the TTFT's p50 and p99 (seconds, null without a first token yet)."""
        return {
            **self.doc(),
            "ttft_p50_s": _rounded(quantile(self.ttft, 0.5)),
            "ttft_p99_s": _rounded(quantile(self.ttft, 0.99)),
        }

    @classmethod
    def parse(cls, doc: object) -> Figures:
        """From ``doc``'s JSON; none at all (a report made before figures were) is empty.
        Malformed figures raise ``TypeError``, ``ValueError`` or ``AttributeError``."""
        if doc is None:
            return cls()
        if not isinstance(doc, Mapping):
            raise TypeError("figures: an object")
        return cls(
            requests=int(doc.get("requests", 0)),
            errors=int(doc.get("errors", 0)),
            ttft=_buckets_parse(doc.get("ttft", [])),
            rejections=_counts(doc.get("rejections", {})),
            canary={str(alias): _counts(pools) for alias, pools in doc.get("canary", {}).items()},
            decisions=_counts(doc.get("decisions", {})),
            pools={
                str(alias): {str(pool): PoolCounts.parse(c) for pool, c in pools.items()}
                for alias, pools in doc.get("pools", {}).items()
            },
        )

    def quantile(self, q: float) -> float | None:
        return quantile(self.ttft, q)


def _counts(doc: Any) -> dict[str, int]:
    return {str(k): int(v) for k, v in doc.items()}


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


def _name(name: str) -> str:
    return name[:NAME_CHARS]


def capped(counts: Mapping[str, int], most: int) -> dict[str, int]:
    """The ``most`` largest counts (ties by name), the rest summed under ``OTHER``."""
    ranked = sorted(((n, k) for k, n in counts.items() if k != OTHER), key=lambda e: (-e[0], e[1]))
    kept = {k: n for n, k in ranked[:most]}
    rest = sum(n for n, _ in ranked[most:]) + counts.get(OTHER, 0)
    if len(ranked) > most or OTHER in counts:
        kept[OTHER] = rest
    return dict(sorted(kept.items()))


def _canary(split: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """Aliases (those with the most requests) and their pools, each capped."""
    per_alias = capped({a: sum(pools.values()) for a, pools in split.items()}, MAX_ALIASES)
    out: dict[str, dict[str, int]] = {}
    for alias, pools in split.items():
        into = alias if alias in per_alias and alias != OTHER else OTHER
        merged = out.setdefault(into, {})
        for pool, n in pools.items():
            _add(merged, pool if into != OTHER else OTHER, n)
    return {alias: capped(pools, MAX_POOLS) for alias, pools in sorted(out.items())}


def _add(into: dict[str, int], key: str, n: int) -> None:
    into[key] = into.get(key, 0) + n


def read(families: Iterable[Metric], rejections: Mapping[tuple[str, str], int]) -> Figures:
    """A replica's figures from its metrics (any families; those of ``*_SAMPLE`` are read)
    and its limiter's rejections, ``(key, reason) -> count``."""
    requests = errors = 0
    buckets: dict[float, int] = {}
    canary: dict[str, dict[str, int]] = {}
    decisions: dict[str, int] = {}
    per_pool: dict[tuple[str, str], _PoolReading] = {}
    for family in families:
        for s in family.samples:
            name, labels, n = s.name, s.labels, round(s.value)
            if name == REQUESTS_SAMPLE:
                requests += n
                if _status(labels.get("status", "")) >= 500:
                    errors += n
                backend = labels.get("backend", _UNROUTED)
                if backend != _UNROUTED:
                    _add(decisions, _name(backend), n)
            elif name == TTFT_SAMPLE:
                le = float(labels["le"])
                buckets[le] = buckets.get(le, 0) + n
            elif name == POOL_REQUESTS_SAMPLE:
                pools = canary.setdefault(_name(labels["alias"]), {})
                _add(pools, _name(labels["pool"]), n)
                _reading(per_pool, labels).requests += n
            elif name == POOL_ERRORS_SAMPLE:  # 5xx, or an error after the stream began
                _reading(per_pool, labels).errors += n
            elif name == POOL_TTFT_SAMPLE:
                _reading(per_pool, labels).ttft[float(labels["le"])] = n
            elif name == POOL_ITL_SAMPLE:
                _reading(per_pool, labels).itl[float(labels["le"])] = n
    split = _canary(canary)
    refused: dict[str, int] = {}
    for (key, _reason), n in rejections.items():
        _add(refused, _name(key), n)
    return Figures(
        requests=requests,
        errors=errors,
        ttft=tuple(sorted(buckets.items())),
        rejections=capped(refused, MAX_KEYS),
        canary=split,
        decisions=capped(decisions, MAX_BACKENDS),
        pools=_pools_of(split, {k: r.counts() for k, r in per_pool.items()}),
    )


@dataclass(slots=True)
class _PoolReading:
    requests: int = 0
    errors: int = 0
    ttft: dict[float, int] = field(default_factory=dict)
    itl: dict[float, int] = field(default_factory=dict)

    def counts(self) -> PoolCounts:
        return PoolCounts(
            self.requests,
            self.errors,
            compact(sorted(self.ttft.items())),
            compact(sorted(self.itl.items())),
        )


def compact(buckets: Sequence[Bucket]) -> tuple[Bucket, ...]:
    """The buckets a quantile needs: each whose count differs from the one before or after
    (and the last). A bound left out counts what the bound below it does, which is how
    ``sum_buckets`` and ``quantile`` read a missing one: nothing is lost, and an idle stretch
    of bounds costs a report nothing."""
    last = len(buckets) - 1
    return tuple(
        b
        for i, b in enumerate(buckets)
        if i == last or b[1] != (buckets[i - 1][1] if i else 0) or b[1] != buckets[i + 1][1]
    )


def _reading(
    per_pool: dict[tuple[str, str], _PoolReading], labels: Mapping[str, str]
) -> _PoolReading:
    key = (_name(labels["alias"]), _name(labels["pool"]))
    reading = per_pool.get(key)
    if reading is None:
        reading = per_pool[key] = _PoolReading()
    return reading


def _pools_of(
    split: Mapping[str, Mapping[str, int]], counts: Mapping[tuple[str, str], PoolCounts]
) -> PoolFigures:
    """The counts of the aliases and pools the canary split kept (not those folded)."""
    return {
        alias: {pool: counts[alias, pool] for pool in pools if (alias, pool) in counts}
        for alias, pools in split.items()
        if alias != OTHER
    }


def _status(status: str) -> int:
    try:
        return int(status)
    except ValueError:
        return 0


def sum_buckets(lists: Iterable[Sequence[Bucket]]) -> tuple[Bucket, ...]:
    """Cumulative buckets summed over the bounds of all of them. Where one list lacks a bound
    another has (replicas of two versions, mid-upgrade, or a bound ``compact`` left out), its
    count there is the count at its own largest bound below: what it knows to be at most that
    long."""
    lists = [list(b) for b in lists if b]
    bounds = sorted({le for b in lists for le, _ in b})
    total = dict.fromkeys(bounds, 0)
    for b in lists:
        for le, n in zip(bounds, _at(b, bounds), strict=True):
            total[le] += n
    return tuple(total.items())


def total(figures: Iterable[Figures]) -> Figures:
    """The figures summed (the fleet's, from its replicas'), capped as a replica's are."""
    fs = list(figures)
    refused: dict[str, int] = {}
    decisions: dict[str, int] = {}
    canary: dict[str, dict[str, int]] = {}
    per_pool: dict[tuple[str, str], list[PoolCounts]] = {}
    for f in fs:
        for alias, counted in f.pools.items():
            for pool, c in counted.items():
                per_pool.setdefault((alias, pool), []).append(c)
        for key, n in f.rejections.items():
            _add(refused, key, n)
        for backend, n in f.decisions.items():
            _add(decisions, backend, n)
        for alias, pools in f.canary.items():
            into = canary.setdefault(alias, {})
            for pool, n in pools.items():
                _add(into, pool, n)
    split = _canary(canary)
    return Figures(
        requests=sum(f.requests for f in fs),
        errors=sum(f.errors for f in fs),
        ttft=sum_buckets(f.ttft for f in fs),
        rejections=capped(refused, MAX_KEYS),
        canary=split,
        decisions=capped(decisions, MAX_BACKENDS),
        pools=_pools_of(split, {k: summed(cs) for k, cs in per_pool.items()}),
    )


def summed(counts: Iterable[PoolCounts]) -> PoolCounts:
    """Counts of one pool added up (over replicas)."""
    counts = list(counts)
    return PoolCounts(
        requests=sum(c.requests for c in counts),
        errors=sum(c.errors for c in counts),
        ttft=sum_buckets(c.ttft for c in counts),
        itl=sum_buckets(c.itl for c in counts),
    )


def quantile(buckets: Iterable[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style quantile from cumulative buckets (linear within a bucket); None
    without an observation."""
    bs = list(buckets)
    if not bs or bs[-1][1] <= 0:
        return None
    rank = q * bs[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in bs:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            span = count - prev_count
            frac = 0.0 if span <= 0 else (rank - prev_count) / span
            return prev_le + (le - prev_le) * frac
        prev_le, prev_count = le, count
    return prev_le
