"""Token-bucket arithmetic, pure: state and time in, decision and new state out.

The in-memory store runs this directly; the Redis store's Lua script is a line-by-line copy of
it (``redis_store.ADMIT_LUA``), so the two stores decide alike. Levels are floats; a missing
bucket is a full one, which is what lets the Redis keys expire once full.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.limits.store import LimitDecision, LimitFigures, Limits, Reason

_CONCURRENCY_RETRY_S = 1.0  # no way to know when a slot frees; suggest a short wait


@dataclass(frozen=True, slots=True)
class Buckets:
    requests: float  # level of the requests bucket
    tokens: float  # level of the tokens bucket
    at: float  # when the levels were computed


def full(limits: Limits, now: float) -> Buckets:
    return Buckets(
        requests=float(limits.requests_per_minute or 0),
        tokens=float(limits.tokens_per_minute or 0),
        at=now,
    )


def refill(b: Buckets, limits: Limits, now: float) -> Buckets:
    elapsed = max(0.0, now - b.at)
    r, t = b.requests, b.tokens
    if limits.requests_per_minute is not None:
        cap = limits.requests_per_minute
        r = min(float(cap), r + elapsed * cap / 60.0)
    if limits.tokens_per_minute is not None:
        cap = limits.tokens_per_minute
        t = min(float(cap), t + elapsed * cap / 60.0)
    return Buckets(r, t, max(now, b.at))


def _window(level: float, cap: int | None) -> LimitFigures | None:
    if cap is None:
        return None
    return LimitFigures(
        limit=cap, remaining=max(0, math.floor(level)), reset=(cap - level) * 60.0 / cap
    )


def admit(
    state: Buckets | None, limits: Limits, cost: int, now: float, in_use: int
) -> tuple[LimitDecision, Buckets | None]:
    """Decide one admission; returns the decision (ticket unset) and the state to store.

    ``in_use`` is the number of concurrency slots currently held by the key. The state to store
    is ``None`` when nothing changed (a refusal).
    """
    b = refill(state if state is not None else full(limits, now), limits, now)
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    reason: Reason | None = None
    retry = 0.0
    if limits.max_concurrent is not None and in_use >= limits.max_concurrent:
        reason, retry = "concurrency", _CONCURRENCY_RETRY_S
    elif rpm is not None and b.requests < 1.0:
        reason, retry = "requests", (1.0 - b.requests) * 60.0 / rpm
    elif tpm is not None and cost > tpm:
        reason, retry = "too_large", 0.0
    elif tpm is not None and b.tokens < cost:
        reason, retry = "tokens", (cost - b.tokens) * 60.0 / tpm
    if reason is not None:
        return (
            LimitDecision(
                allowed=False,
                reason=reason,
                retry_after=retry,
                requests=_window(b.requests, rpm),
                tokens=_window(b.tokens, tpm),
            ),
            None,
        )
    after = Buckets(
        requests=b.requests - 1.0 if rpm is not None else b.requests,
        tokens=b.tokens - cost if tpm is not None else b.tokens,
        at=b.at,
    )
    return (
        LimitDecision(
            allowed=True, requests=_window(after.requests, rpm), tokens=_window(after.tokens, tpm)
        ),
        after,
    )


def settle(state: Buckets | None, limits: Limits, delta_tokens: int, now: float) -> Buckets:
    """Give back ``delta_tokens`` (negative: take more). Debt is bounded by one minute's budget."""
    b = refill(state if state is not None else full(limits, now), limits, now)
    tpm = limits.tokens_per_minute
    if tpm is None:
        return b
    t = min(float(tpm), max(-float(tpm), b.tokens + delta_tokens))
    return Buckets(b.requests, t, b.at)


def seconds_to_full(b: Buckets, limits: Limits) -> float:
    """After this long untouched, the buckets are full: the stored state may be forgotten."""
    s = 0.0
    if limits.requests_per_minute is not None:
        s = max(s, (limits.requests_per_minute - b.requests) * 60.0 / limits.requests_per_minute)
    if limits.tokens_per_minute is not None:
        s = max(s, (limits.tokens_per_minute - b.tokens) * 60.0 / limits.tokens_per_minute)
    return s
