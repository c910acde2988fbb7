"""Rate-limit headers and the 429, as OpenAI sends them. Pure.

OpenAI's 429 body: ``{"error": {"message": "Rate limit reached for ... on tokens per min (TPM):
Limit 30000, Used 18928, Requested 11159. Please try again in 174ms.", "type": "tokens",
"param": null, "code": "rate_limit_exceeded"}}``; its ``x-ratelimit-reset-*`` durations are
Go-style ("174ms", "1s", "7.66s", "6m0s").
"""

from __future__ import annotations

import math

from backends.errors import RateLimited
from gateway.limits.store import LimitDecision, LimitFigures

_WHAT = {
    "requests": "requests per min (RPM)",
    "tokens": "tokens per min (TPM)",
    "concurrency": "concurrent requests",
    "too_large": "tokens per min (TPM)",
}


def format_duration(seconds: float) -> str:
    """Go-style duration, millisecond precision: ``"0s"``, ``"20ms"``, ``"7.66s"``, ``"6m0s"``."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s = f"{rest // 1000}.{rest % 1000:03d}".rstrip("0").rstrip(".") + "s"
    if h:
        return f"{h}h{m}m{s}"
    if m:
        return f"{m}m{s}"
    return s


def _trio(w: LimitFigures, kind: str) -> dict[str, str]:
    return {
        f"x-ratelimit-limit-{kind}": str(w.limit),
        f"x-ratelimit-remaining-{kind}": str(w.remaining),
        f"x-ratelimit-reset-{kind}": format_duration(w.reset),
    }


def rate_limit_headers(decision: LimitDecision) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers for any response (only the limits the key has)."""
    out: dict[str, str] = {}
    if decision.requests is not None:
        out |= _trio(decision.requests, "requests")
    if decision.tokens is not None:
        out |= _trio(decision.tokens, "tokens")
    return out


def retry_after_header(seconds: float) -> str:
    """Retry-After is whole seconds (RFC 9110): rounded up, at least 1."""
    return str(max(1, math.ceil(seconds)))


def rate_limited(decision: LimitDecision, *, key_name: str, requested_tokens: int) -> RateLimited:
    """The 429 for a refused decision."""
    reason = decision.reason or "requests"
    headers = rate_limit_headers(decision)
    what = _WHAT[reason]
    if reason == "too_large":
        limit = decision.tokens.limit if decision.tokens else 0
        # Waiting never helps: no Retry-After, and the message says what to change.
        return RateLimited(
            f"Request too large for `{key_name}` on {what}: Limit {limit}, Requested "
            f"{requested_tokens}. Reduce the prompt or max_tokens.",
            limit_type="tokens",
            headers=headers,
        )
    headers["Retry-After"] = retry_after_header(decision.retry_after)
    if reason == "concurrency":
        message = f"Too many concurrent requests for `{key_name}`. Please try again shortly."
    else:
        w = decision.requests if reason == "requests" else decision.tokens
        used = f" Limit {w.limit}, Remaining {w.remaining}," if w is not None else ""
        requested = 1 if reason == "requests" else requested_tokens
        message = (
            f"Rate limit reached for `{key_name}` on {what}:{used} Requested {requested}. "
            f"Please try again in {format_duration(decision.retry_after)}."
        )
    return RateLimited(
        message, limit_type="tokens" if reason == "tokens" else "requests", headers=headers
    )
