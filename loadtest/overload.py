"""What an overload run shows, class by class. Pure: records in, figures out, no clock.

- ``Attempt``: one HTTP attempt as the client saw it; ``outcome`` says how it ended
  (``classify``): ``ok``, ``refused`` (429 or 503 with ``Retry-After``: the client waits that
  long and sends it again), ``broken`` (the stream ended after some content without
  ``[DONE]``, or with an error event: lost mid-stream) or ``error`` (anything else).
- ``Request``: what one user asked, with every attempt it took.
- ``capacity``: the highest arrival rate whose TTFT p99 is still within ``factor`` times the
  idle one (the lowest rate's), a single level over it taken for noise.
- ``class_figures``: per class, what its requests got; ``timeline``: per class and window (by
  send time), the TTFT p99 of the answers and the refusals.
- ``budget_windows``: extra attempts that reached the engines over each sliding window against
  what the retry budget allows for the requests let through in it.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from loadtest.stats import percentile

Outcome = Literal["ok", "refused", "broken", "error"]
REFUSALS = frozenset({429, 503})


def classify(
    status: int,
    *,
    retry_after: float | None,
    done: bool,
    stream_error: bool,
    content: int,
    failed: bool = False,
) -> Outcome:
    """How an attempt ended: ``status`` (0: no answer), whether its stream ended with
    ``[DONE]`` or an error event, how many content events came, whether the connection
    failed (``failed``)."""
    if failed or status == 200:
        if not failed and done and not stream_error:
            return "ok"
        return "broken" if content > 0 else "error"
    if status in REFUSALS and retry_after is not None:
        return "refused"
    return "error"


@dataclass(slots=True)
class Attempt:
    sent: float  # seconds from the overload's start
    status: int = 0
    code: str | None = None  # the error body's ``code`` (shed_by_priority, queue_timeout...)
    retry_after: float | None = None
    ttft: float | None = None  # from this attempt's send
    ended: float | None = None
    content: int = 0  # content events received
    outcome: Outcome = "error"
    error: str | None = None  # what went wrong, for outcomes other than ok and refused


@dataclass(slots=True)
class Request:
    cls: str
    first_sent: float
    attempts: list[Attempt] = field(default_factory=list)
    gave_up: bool = False  # refused until the client's deadline

    @property
    def last(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def ok(self) -> bool:
        return self.last is not None and self.last.outcome == "ok"

    @property
    def user_ttft(self) -> float | None:
        """First token as the user saw it: from the first send, every wait included."""
        last = self.last
        if last is None or last.ttft is None or last.outcome != "ok":
            return None
        return last.sent + last.ttft - self.first_sent


def capacity(levels: Sequence[tuple[float, float]], factor: float = 2.0) -> float:
    """The highest rate of ``levels`` ((requests/s, TTFT p99 s), by rising rate) before two
    levels in a row have a p99 over ``factor`` times the first (idle) one: one level over,
    then one within, is taken for noise (a Poisson burst, another process on the machine)."""
    if not levels:
        raise ValueError("no levels measured")
    idle = levels[0][1]
    best = levels[0][0]
    for (rate, p99), nxt in zip(levels, [*levels[1:], None], strict=True):
        over = not p99 <= factor * idle  # NaN (nothing answered) counts as over
        if over and (nxt is None or not nxt[1] <= factor * idle):
            break
        if not over:
            best = rate
    return best


def _ms(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else round(x * 1e3, 1)


def _pct(values: Sequence[float], p: float) -> float | None:
    return percentile(sorted(values), p) if values else None


def class_figures(
    requests: Iterable[Request], classes: Sequence[str], *, since: float = 0.0
) -> dict[str, dict[str, Any]]:
    """Per class, the requests first sent at ``since`` or later: how they ended, their
    attempts and refusals (by code, with the Retry-After values), TTFT p50/p99 of the answers
    (from the answered attempt's send, and as the user saw it), when the first refusal came."""
    by_class: dict[str, list[Request]] = {c: [] for c in classes}
    for r in requests:
        if r.first_sent >= since and r.cls in by_class:
            by_class[r.cls].append(r)
    out: dict[str, dict[str, Any]] = {}
    for cls, reqs in by_class.items():
        attempts = [a for r in reqs for a in r.attempts]
        refused = [a for a in attempts if a.outcome == "refused"]
        answered = [r for r in reqs if r.ok]
        ttft = [a.ttft for r in answered if (a := r.last) is not None and a.ttft is not None]
        user = [t for r in answered if (t := r.user_ttft) is not None]
        e2e = [a.ended - r.first_sent for r in answered if (a := r.last) and a.ended is not None]
        retry_after = [a.retry_after for a in refused if a.retry_after is not None]
        ended_badly = Counter(
            f"{a.outcome}:{a.error or a.status}"
            for r in reqs
            if (a := r.last) is not None and a.outcome in ("broken", "error")
        )
        out[cls] = {
            "requests": len(reqs),
            "ok": len(answered),
            "errors": sum(ended_badly.values()),
            "error_kinds": dict(ended_badly),
            "broken_mid_stream": sum(1 for a in attempts if a.outcome == "broken"),
            "gave_up": sum(1 for r in reqs if r.gave_up),
            "unfinished": sum(1 for r in reqs if r.last is None),
            "attempts": len(attempts),
            "refused": len(refused),
            "refused_by_code": dict(Counter(a.code or str(a.status) for a in refused)),
            "requests_refused": sum(
                1 for r in reqs if any(a.outcome == "refused" for a in r.attempts)
            ),
            "retry_after_s": {
                "p50": _pct(retry_after, 50),
                "max": max(retry_after, default=None),
                "values": dict(sorted(Counter(int(v) for v in retry_after).items())),
            },
            "first_refused_at_s": min(
                (a.sent if a.ended is None else a.ended for a in refused), default=None
            ),
            "ttft_ms": {"p50": _ms(_pct(ttft, 50)), "p99": _ms(_pct(ttft, 99))},
            "user_ttft_ms": {"p50": _ms(_pct(user, 50)), "p99": _ms(_pct(user, 99))},
            "user_e2e_ms": {"p50": _ms(_pct(e2e, 50)), "p99": _ms(_pct(e2e, 99))},
        }
    return out


def timeline(
    requests: Iterable[Request], classes: Sequence[str], *, width: float, start: float, end: float
) -> dict[str, list[dict[str, Any]]]:
    """Per class, each ``width``-s window from ``start`` to ``end``: attempts sent and the
    TTFT p99 (ms) of those answered, by send time; refusals (429, 503), by the time of the
    refusal (a request may wait in the queue before it is refused)."""
    n = max(1, math.ceil((end - start) / width))

    def window(t: float) -> int | None:
        i = math.floor((t - start) / width)
        return i if 0 <= i < n else None

    sent = {c: [0] * n for c in classes}
    refused = {c: {status: [0] * n for status in sorted(REFUSALS)} for c in classes}
    ttfts: dict[str, list[list[float]]] = {c: [[] for _ in range(n)] for c in classes}
    for r in requests:
        if r.cls not in sent:
            continue
        for a in r.attempts:
            if (i := window(a.sent)) is not None:
                sent[r.cls][i] += 1
                if a.outcome == "ok" and a.ttft is not None:
                    ttfts[r.cls][i].append(a.ttft)
            at = a.ended if a.ended is not None else a.sent
            if a.outcome == "refused" and (j := window(at)) is not None:
                refused[r.cls][a.status][j] += 1
    return {
        c: [
            {
                "t": start + i * width,
                "sent": sent[c][i],
                "ttft_p99_ms": _ms(_pct(ttfts[c][i], 99)),
                **{f"refused_{status}": refused[c][status][i] for status in sorted(REFUSALS)},
            }
            for i in range(n)
        ]
        for c in classes
    }


def budget_windows(
    counts: Sequence[tuple[float, float, float]],
    *,
    ratio: float,
    min_per_second: float,
    window: float,
) -> list[dict[str, float]]:
    """For each of ``counts`` ((time, attempts the engines had received so far, requests the
    gateway had let through so far), by time) at least ``window`` s after the first: over the
    window, the attempts the engines received, the requests let through, the extra attempts
    (the difference) and what the retry budget allows for them (``ratio`` per request plus
    ``min_per_second``)."""
    times = [t for t, _, _ in counts]
    out = []
    for t, received, admitted in counts:
        if t - times[0] < window:
            continue
        t1, received1, admitted1 = counts[bisect.bisect_right(times, t - window) - 1]
        requests = admitted - admitted1
        out.append(
            {
                "t": t,
                "received": received - received1,
                "requests": requests,
                "extra": received - received1 - requests,
                "allowed": ratio * requests + min_per_second * (t - t1),
            }
        )
    return out


def _cell(x: float | None, fmt: str = ",.0f") -> str:
    return "-" if x is None else format(x, fmt)


def class_table(results: Sequence[dict[str, Any]]) -> str:
    """The figures per case and class (``class_figures`` of each result) as a Markdown table."""
    rows = [
        "| case | class | requests | completed | errors | broken mid-stream | refused (code: "
        "times) | Retry-After p50 / max (s) | TTFT p50 / p99 (ms) | TTFT p99 seen by the user (ms) "
        "| first refused at (s) |",
        "|---|---|---:|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for res in results:
        for cls, f in res["figures"].items():
            codes = ", ".join(f"{c}: {n}" for c, n in sorted(f["refused_by_code"].items()))
            ra = f["retry_after_s"]
            values = f"{_cell(ra['p50'], 'g')} / {_cell(ra['max'], 'g')}" if ra["max"] else ""
            rows.append(
                f"| {res['case']} | {cls} | {f['requests']} | {f['ok']} | {f['errors']} | "
                f"{f['broken_mid_stream']} | {codes or '-'} | {values or '-'} | "
                f"{_cell(f['ttft_ms']['p50'])} / {_cell(f['ttft_ms']['p99'])} | "
                f"{_cell(f['user_ttft_ms']['p99'])} | {_cell(f['first_refused_at_s'], '.1f')} |"
            )
    return "\n".join(rows)


def budget_table(results: Sequence[dict[str, Any]]) -> str:
    """Per case: requests let through, extra attempts taken and refused by the budget, the
    most extra attempts that reached the engines in one budget window against its allowance."""
    rows = [
        "| case | requests let through | extra attempts taken (retry / hedge / continuation) "
        "| refused by the budget | engines received | most extra at the engines in a window "
        "(allowed then) | budget use, highest |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        b = res["final"]["budget"] or {}
        adm = res["final"]["admission"] or {}
        taken = " / ".join(_cell(b.get(f"{k}_taken")) for k in ("retry", "hedge", "continuation"))
        refused = sum(v for k, v in b.items() if k.endswith("_refused"))
        windows = res["budget_windows"]
        worst = max(windows, key=lambda w: (w["extra"], -w["allowed"])) if windows else None
        engines = res["samples"][-1]["engines"] if res["samples"] else {}
        received = sum(e["received"] for e in engines.values())
        through = adm.get("admitted_at_once", 0) + adm.get("admitted_after_wait", 0)
        most = "-" if worst is None else f"{worst['extra']:.0f} ({worst['allowed']:.0f})"
        rows.append(
            f"| {res['case']} | {through:,.0f} | {taken} | {refused:,.0f} | {received:,.0f} | "
            f"{most} | {_cell(res['budget_use_max'], '.0%')} |"
        )
    return "\n".join(rows)
