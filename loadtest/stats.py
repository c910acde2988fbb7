"""Per-request records and their summaries. Pure: plain data in, figures out.

Definitions follow vLLM's ``benchmarks/benchmark_serving.py`` so our figures can be set beside
the field's (see ``loadtest.stream`` for what a content event is):

- **TTFT**: request sent -> first content event. For a non-streaming request, = E2E.
- **ITL**: every gap between successive content events of a request, pooled over requests
  (vLLM's ``itls``). Events that arrive in one read give 0 ms gaps.
- **TPOT**: per streamed request, (E2E - TTFT) / (output tokens - 1); requests of one token
  and non-streaming requests have none.
- **E2E**: request sent -> the last byte of the answer.
- **Output tokens**: ``usage.completion_tokens`` when the server sends it (we ask for it with
  ``stream_options.include_usage``), else the number of content events.
- **Percentiles**: linear interpolation between closest ranks (``numpy.percentile``'s
  default, which vLLM uses).
- **Throughput**: successful requests (and their output tokens) divided by the measured
  window: from the first measured request's start to the last measured request's end.
- **Goodput** (vLLM's ``--goodput ttft:MS tpot:MS``): requests that succeeded *and* met every
  SLO given; the ITL SLO is checked against the request's TPOT (its mean inter-token
  latency), as vLLM does. Reported as a share of measured requests and per second.

Warm-up requests (``RequestRecord.warmup``) are left out of every figure.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtest.stream import StreamTimer


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the client saw it. Times in seconds; ``start`` is since the run began."""

    start: float
    ttft: float | None = None
    itls: tuple[float, ...] = ()
    e2e: float | None = None
    tokens_out: int = 0
    status: int = 0  # HTTP status; 0 when no answer came
    error: str | None = None  # kind: http_503, connect, disconnect, stall, timeout, ...
    warmup: bool = False
    prompt_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.tokens_out < 2 or not self.itls:
            return None  # no stream of tokens (non-streaming, or one token): no TPOT
        return (self.e2e - self.ttft) / (self.tokens_out - 1)

    def token_times(self) -> list[float]:
        """When each content event arrived, since the run began."""
        if self.ttft is None:
            return []
        t = self.start + self.ttft
        times = [t]
        for gap in self.itls:
            t += gap
            times.append(t)
        return times


@dataclass(frozen=True, slots=True)
class StreamTimings:
    ttft: float | None
    itls: tuple[float, ...]
    content_events: int
    done: bool
    error: str | None
    usage_tokens: int | None


def timings_from_stream(sent_at: float, reads: Iterable[tuple[float, bytes]]) -> StreamTimings:
    """TTFT and ITLs of a recorded stream: ``reads`` are (time, bytes) of each socket read."""
    timer = StreamTimer()
    for now, chunk in reads:
        timer.feed(now, chunk)
    return timings_from_timer(sent_at, timer)


def timings_from_timer(sent_at: float, timer: StreamTimer) -> StreamTimings:
    times = timer.token_times
    return StreamTimings(
        ttft=times[0] - sent_at if times else None,
        itls=tuple(b - a for a, b in itertools.pairwise(times)),
        content_events=len(times),
        done=timer.done,
        error=timer.error,
        usage_tokens=timer.usage_tokens,
    )


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of sorted values, linearly interpolated (numpy's)."""
    if not sorted_values:
        return math.nan
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be within 0..100, got {p}")
    rank = (len(sorted_values) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = rank - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


@dataclass(frozen=True, slots=True)
class Dist:
    """mean, p50, p90, p99 and max of some values (seconds); NaN when there are none."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Dist:
        v = sorted(values)
        if not v:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(
            n=len(v),
            mean=math.fsum(v) / len(v),
            p50=percentile(v, 50),
            p90=percentile(v, 90),
            p99=percentile(v, 99),
            max=v[-1],
        )

    def to_json_ms(self) -> dict[str, float | int | None]:
        def ms(x: float) -> float | None:
            return None if math.isnan(x) else round(x * 1e3, 3)

        return {
            "n": self.n,
            "mean": ms(self.mean),
            "p50": ms(self.p50),
            "p90": ms(self.p90),
            "p99": ms(self.p99),
            "max": ms(self.max),
        }


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objectives for goodput, in seconds; None means no such objective."""

    ttft: float | None = None
    itl: float | None = None
    e2e: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft is not None and (r.ttft is None or r.ttft > self.ttft):
            return False
        if self.itl is not None and (tpot := r.tpot) is not None and tpot > self.itl:
            return False
        return not (self.e2e is not None and (r.e2e is None or r.e2e > self.e2e))

    @property
    def empty(self) -> bool:
        return self.ttft is None and self.itl is None and self.e2e is None


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    ok: int
    errors: dict[str, int]
    window: float  # seconds
    request_throughput: float  # successful requests/s
    output_throughput: float  # output tokens/s (successful requests)
    ttft: Dist
    itl: Dist
    tpot: Dist
    e2e: Dist
    tokens_out: Dist  # per request (counts, not seconds)
    goodput_share: float | None = None
    goodput_rps: float | None = None
    slo: Slo = field(default_factory=Slo)

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "ok": self.ok,
            "errors": dict(self.errors),
            "window_s": round(self.window, 3),
            "request_throughput": round(self.request_throughput, 3),
            "output_throughput": round(self.output_throughput, 1),
            "ttft_ms": self.ttft.to_json_ms(),
            "itl_ms": self.itl.to_json_ms(),
            "tpot_ms": self.tpot.to_json_ms(),
            "e2e_ms": self.e2e.to_json_ms(),
            "tokens_out_mean": None if math.isnan(self.tokens_out.mean) else self.tokens_out.mean,
            "goodput_share": self.goodput_share,
            "goodput_rps": self.goodput_rps,
            "slo_ms": {
                k: None if v is None else v * 1e3
                for k, v in (("ttft", self.slo.ttft), ("itl", self.slo.itl), ("e2e", self.slo.e2e))
            },
        }


def measured(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if not r.warmup]


def summarize(records: Iterable[RequestRecord], slo: Slo | None = None) -> Summary:
    """Figures over the non-warm-up records (see the module docstring for definitions)."""
    rs = measured(records)
    slo = slo or Slo()
    good = [r for r in rs if r.ok]
    errors = Counter(r.error for r in rs if r.error is not None)
    if rs:
        first = min(r.start for r in rs)
        last = max(r.start + (r.e2e or 0.0) for r in rs)
        window = max(last - first, 1e-9)
    else:
        window = 0.0
    per_s = (lambda n: n / window) if window > 0 else (lambda n: 0.0)
    goodput_share = goodput_rps = None
    if not slo.empty and rs:
        n_good = sum(1 for r in rs if slo.met_by(r))
        goodput_share = n_good / len(rs)
        goodput_rps = per_s(n_good)
    return Summary(
        requests=len(rs),
        ok=len(good),
        errors=dict(sorted(errors.items())),
        window=window,
        request_throughput=per_s(len(good)),
        output_throughput=per_s(sum(r.tokens_out for r in good)),
        ttft=Dist.of(r.ttft for r in good if r.ttft is not None),
        itl=Dist.of(gap for r in good for gap in r.itls),
        tpot=Dist.of(t for r in good if (t := r.tpot) is not None),
        e2e=Dist.of(r.e2e for r in good if r.e2e is not None),
        tokens_out=Dist.of(float(r.tokens_out) for r in good),
        goodput_share=goodput_share,
        goodput_rps=goodput_rps,
        slo=slo,
    )


@dataclass(frozen=True, slots=True)
class Bucket:
    """One time slice of a run: what started, finished and streamed in [t, t + width)."""

    t: float
    started: int
    completed: int
    errors: int
    tokens: int
    ttft_p50: float
    ttft_p99: float


def timeline(records: Iterable[RequestRecord], width: float = 1.0) -> list[Bucket]:
    """Per-``width`` buckets over the whole run (warm-up included, so it shows on plots).

    TTFT is attributed to the bucket in which the request started; tokens to the bucket in
    which they arrived; completions and errors to the bucket in which the request ended.
    """
    rs = list(records)
    if not rs or width <= 0:
        return []
    end = max(r.start + (r.e2e or 0.0) for r in rs)
    n = int(end // width) + 1
    started = [0] * n
    completed = [0] * n
    errors = [0] * n
    tokens = [0] * n
    ttfts: list[list[float]] = [[] for _ in range(n)]

    def idx(t: float) -> int:
        return min(max(int(t // width), 0), n - 1)

    for r in rs:
        i = idx(r.start)
        started[i] += 1
        if r.ok and r.ttft is not None:
            ttfts[i].append(r.ttft)
        j = idx(r.start + (r.e2e or 0.0))
        if r.ok:
            completed[j] += 1
        else:
            errors[j] += 1
        for t in r.token_times():
            tokens[idx(t)] += 1
    out = []
    for i in range(n):
        s = sorted(ttfts[i])
        out.append(
            Bucket(
                t=i * width,
                started=started[i],
                completed=completed[i],
                errors=errors[i],
                tokens=tokens[i],
                ttft_p50=percentile(s, 50),
                ttft_p99=percentile(s, 99),
            )
        )
    return out


def loop_lag_warning(lag: Dist, ttft: Dist, *, client_cpu_share: float | None = None) -> str | None:
    """Why the client's own figures may be distorted, or None.

    The client's event loop running late adds its lag to every time it stamps: we warn when
    the p99 lag is above 5 ms or above a tenth of the TTFT p50, or when the client used more
    than 90 % of its core (it then paces the load rather than the server).
    """
    reasons = []
    if lag.n and not math.isnan(lag.p99):
        limit = 0.005
        if not math.isnan(ttft.p50):
            limit = min(limit, max(0.1 * ttft.p50, 0.001))
        if lag.p99 > limit:
            reasons.append(
                f"client event-loop lag p99 {lag.p99 * 1e3:.1f} ms (max {lag.max * 1e3:.1f} ms) "
                f"exceeds {limit * 1e3:.1f} ms"
            )
    if client_cpu_share is not None and client_cpu_share > 0.9:
        reasons.append(f"client used {client_cpu_share:.0%} of a core")
    if not reasons:
        return None
    return "; ".join(reasons) + ": latency figures include client-side delay"
