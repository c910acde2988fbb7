"""The 429 envelope and x-ratelimit-* headers, as OpenAI sends them."""

from __future__ import annotations

import pytest

from gateway.limits.headers import format_duration, rate_limit_headers, rate_limited
from gateway.limits.store import LimitDecision, LimitFigures


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0201, "21ms"),
        (0.174, "174ms"),
        (1, "1s"),
        (7.66, "7.66s"),
        (59.9996, "1m0s"),
        (360, "6m0s"),
        (61.5, "1m1.5s"),
        (3600, "1h0m0s"),
        (-3, "0s"),
    ],
)
def test_durations_are_formatted_like_openai(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def refused(reason: str, retry: float) -> LimitDecision:
    return LimitDecision(
        allowed=False,
        reason=reason,  # type: ignore[arg-type]
        retry_after=retry,
        requests=LimitFigures(limit=60, remaining=0, reset=1.0),
        tokens=LimitFigures(limit=1000, remaining=120, reset=52.8),
    )


def test_headers_carry_both_trios() -> None:
    assert rate_limit_headers(refused("requests", 1.0)) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "120",
        "x-ratelimit-reset-tokens": "52.8s",
    }


def test_only_configured_limits_get_headers() -> None:
    assert rate_limit_headers(LimitDecision(allowed=True)) == {}


def test_requests_429_has_openai_shape_and_retry_after_rounded_up() -> None:
    err = rate_limited(refused("requests", 0.4), key_name="key:alice", requested_tokens=30)
    assert err.status == 429
    env = err.envelope()["error"]
    assert env["type"] == "requests"
    assert env["code"] == "rate_limit_exceeded"
    assert "requests per min (RPM)" in env["message"]
    assert "try again in 400ms" in env["message"]
    assert err.headers["Retry-After"] == "1"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"


def test_tokens_429_names_the_tokens_limit() -> None:
    err = rate_limited(refused("tokens", 12.2), key_name="key:alice", requested_tokens=300)
    env = err.envelope()["error"]
    assert env["type"] == "tokens"
    assert "Requested 300" in env["message"]
    assert err.headers["Retry-After"] == "13"


def test_too_large_429_has_no_retry_after() -> None:
    err = rate_limited(refused("too_large", 0), key_name="key:alice", requested_tokens=5000)
    assert "Retry-After" not in err.headers
    assert err.envelope()["error"]["type"] == "tokens"
    assert "too large" in err.message


def test_concurrency_429() -> None:
    err = rate_limited(refused("concurrency", 1.0), key_name="anonymous", requested_tokens=1)
    assert err.envelope()["error"]["type"] == "requests"
    assert err.headers["Retry-After"] == "1"
