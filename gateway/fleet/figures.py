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
_UNROUTED: Final = "none"  # the backend label of a request that reached none

Bucket = tuple[float, int]  # (upper bound, cumulative count)


@dataclass(frozen=True, slots=True)
class Figures:
    """What one replica (or, summed, the fleet) served: cumulative counts."""

    requests: int = 0
    errors: int = 0
    ttft: tuple[Bucket, ...] = ()  # by bound, ascending; the last bound +inf
    rejections: dict[str, int] = field(default_factory=dict)  # per API key
    canary: dict[str, dict[str, int]] = field(default_factory=dict)  # alias -> pool -> n
    decisions: dict[str, int] = field(default_factory=dict)  # per backend

    def doc(self) -> dict[str, Any]:
        """As JSON has it: the +inf bound is null."""
        return {
            "requests": self.requests,
            "errors": self.errors,
            "ttft": [[None if math.isinf(le) else le, n] for le, n in self.ttft],
            "rejections": dict(self.rejections),
            "canary": {alias: dict(pools) for alias, pools in self.canary.items()},
            "decisions": dict(self.decisions),
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
            ttft=tuple(
                (math.inf if le is None else float(le), int(n)) for le, n in doc.get("ttft", [])
            ),
            rejections=_counts(doc.get("rejections", {})),
            canary={str(alias): _counts(pools) for alias, pools in doc.get("canary", {}).items()},
            decisions=_counts(doc.get("decisions", {})),
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
    refused: dict[str, int] = {}
    for (key, _reason), n in rejections.items():
        _add(refused, _name(key), n)
    return Figures(
        requests=requests,
        errors=errors,
        ttft=tuple(sorted(buckets.items())),
        rejections=capped(refused, MAX_KEYS),
        canary=_canary(canary),
        decisions=capped(decisions, MAX_BACKENDS),
    )


def _status(status: str) -> int:
    try:
        return int(status)
    except ValueError:
        return 0


def sum_buckets(lists: Iterable[Sequence[Bucket]]) -> tuple[Bucket, ...]:
    """Cumulative buckets summed over the bounds of all of them. Where one list lacks a bound
    another has (replicas of two versions, mid-upgrade), its count there is the count at its
    own largest bound below: what it knows to be at most that long."""
    lists = [list(b) for b in lists if b]
    bounds = sorted({le for b in lists for le, _ in b})
    total = dict.fromkeys(bounds, 0)
    for b in lists:
        i, below = 0, 0
        for le in bounds:
            while i < len(b) and b[i][0] <= le:
                below = b[i][1]
                i += 1
            total[le] += below
    return tuple(total.items())


def total(figures: Iterable[Figures]) -> Figures:
    """The figures summed (the fleet's, from its replicas'), capped as a replica's are."""
    fs = list(figures)
    refused: dict[str, int] = {}
    decisions: dict[str, int] = {}
    canary: dict[str, dict[str, int]] = {}
    for f in fs:
        for key, n in f.rejections.items():
            _add(refused, key, n)
        for backend, n in f.decisions.items():
            _add(decisions, backend, n)
        for alias, pools in f.canary.items():
            into = canary.setdefault(alias, {})
            for pool, n in pools.items():
                _add(into, pool, n)
    return Figures(
        requests=sum(f.requests for f in fs),
        errors=sum(f.errors for f in fs),
        ttft=sum_buckets(f.ttft for f in fs),
        rejections=capped(refused, MAX_KEYS),
        canary=_canary(canary),
        decisions=capped(decisions, MAX_BACKENDS),
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
