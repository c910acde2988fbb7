"""API keys: who is calling, and with which limits. Pure (headers in, principal out).

Keys are configured by their sha256 (``llm-gateway keys hash``); the plain key is never stored,
logged or forwarded. A presented key is hashed and looked up by its hash: a lookup's timing
can only leak facts about the digest, which an attacker cannot steer towards a valid key, and
the match is then confirmed with ``hmac.compare_digest``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from backends.errors import AuthenticationError
from gateway.limits.settings import LimitsSettings, TierSettings
from gateway.limits.store import Limits

ANONYMOUS: Final = "anonymous"


def hash_key(key: str) -> str:
    """The form a key is configured in: ``sha256:<64 hex digits>``."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller of one request. ``id`` names it in limit stores, logs and metrics."""

    id: str
    tier: str
    limits: Limits
    max_priority: int
    authenticated: bool
    objective: str | None = None  # what predicted_latency minimises for it (its tier's)


def _limits(t: TierSettings) -> Limits:
    return Limits(
        requests_per_minute=t.requests_per_minute,
        tokens_per_minute=t.tokens_per_minute,
        max_concurrent=t.max_concurrent,
    )


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key from ``Authorization: Bearer <key>`` or ``x-api-key: <key>``, if any."""
    auth = headers.get("Authorization") or headers.get("authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("x-api-key") or headers.get("X-Api-Key")
    if key and key.strip():
        return key.strip()
    return None


class Authenticator:
    def __init__(self, settings: LimitsSettings) -> None:
        self.required = settings.auth
        self._by_hash: dict[bytes, tuple[bytes, Principal]] = {}
        for k in settings.keys:
            tier = settings.tiers[k.tier]
            digest = bytes.fromhex(k.hash)
            self._by_hash[digest] = (
                digest,
                Principal(
                    id=f"key:{k.name}",
                    tier=k.tier,
                    limits=_limits(tier),
                    max_priority=tier.max_priority,
                    authenticated=True,
                    objective=tier.objective,
                ),
            )
        anon = settings.tiers[settings.anonymous_tier]
        self.anonymous = Principal(
            id=ANONYMOUS,
            tier=settings.anonymous_tier,
            limits=_limits(anon),
            max_priority=anon.max_priority,
            authenticated=False,
            objective=anon.objective,
        )

    def lookup(self, key: str) -> Principal | None:
        digest = hashlib.sha256(key.encode()).digest()
        entry = self._by_hash.get(digest)
        if entry is not None and hmac.compare_digest(entry[0], digest):
            return entry[1]
        return None

    def authenticate(self, headers: Mapping[str, str]) -> Principal:
        """The caller; ``AuthenticationError`` (401) when auth is on and the key is bad.

        With auth off, a known key still selects its own tier; anything else is anonymous.
        """
        key = presented_key(headers)
        principal = self.lookup(key) if key is not None else None
        if principal is not None:
            return principal
        if not self.required:
            return self.anonymous
        if key is None:
            raise AuthenticationError(
                "You didn't provide an API key. Provide it in the Authorization header "
                "(Authorization: Bearer YOUR_KEY) or the x-api-key header.",
                code="missing_api_key",
            )
        raise AuthenticationError("Incorrect API key provided.", code="invalid_api_key")
