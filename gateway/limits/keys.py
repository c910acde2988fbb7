"""API keys: who is calling, and with which limits. Pure (headers in, principal out).

Keys are configured by their sha256 (``llm-gateway keys hash``); the plain key is never stored,
logged or forwarded. A presented key is hashed and looked up by its hash: a lookup's timing
can only leak facts about the digest, which an attacker cannot steer towards a valid key, and
the match is then confirmed with ``hmac.compare_digest``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from backends.errors import AuthenticationError, InvalidRequest, NotFound
from gateway.limits.settings import LimitsSettings, TierSettings
from gateway.limits.store import Limits

ANONYMOUS: Final = "anonymous"
_NAME: Final = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")
_HEX: Final = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")


def hash_key(key: str) -> str:
    """The form a key is configured in: ``sha256:<64 hex digits>``."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Budget:
    """A key's token budget: ``tokens`` in all, spent as counted under ``counter`` (a new
    counter each time a budget is set, unless it keeps the last one's count)."""

    tokens: int
    counter: str


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller of one request. ``id`` names it in limit stores, logs and metrics."""

    id: str
    tier: str
    limits: Limits
    max_priority: int
    authenticated: bool
    objective: str | None = None  # what predicted_latency minimises for it (its tier's)
    budget: Budget | None = None


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
    """The keys in force: the configuration's, plus those added and less those revoked at run
    time (through the admin API, and in a fleet through its change log: ``state``/``restore``
    carry the run-time part in a snapshot)."""

    def __init__(self, settings: LimitsSettings) -> None:
        self.required = settings.auth
        self._tiers = settings.tiers
        self._by_hash: dict[bytes, tuple[bytes, Principal]] = {}
        self._by_name: dict[str, tuple[bytes, str, str]] = {}  # name -> digest, tier, source
        self._configured = {k.name: (bytes.fromhex(k.hash), k.tier) for k in settings.keys}
        self._budgets: dict[str, Budget] = {}  # by key name, set at run time
        for name, (digest, tier) in self._configured.items():
            self._put(name, digest, tier, "config")
        anon = settings.tiers[settings.anonymous_tier]
        self.anonymous = Principal(
            id=ANONYMOUS,
            tier=settings.anonymous_tier,
            limits=_limits(anon),
            max_priority=anon.max_priority,
            authenticated=False,
            objective=anon.objective,
        )

    def _put(self, name: str, digest: bytes, tier_name: str, source: str) -> None:
        tier = self._tiers[tier_name]
        self._by_hash[digest] = (
            digest,
            Principal(
                id=f"key:{name}",
                tier=tier_name,
                limits=_limits(tier),
                max_priority=tier.max_priority,
                authenticated=True,
                objective=tier.objective,
                budget=self._budgets.get(name),
            ),
        )
        self._by_name[name] = (digest, tier_name, source)

    # -- changes at run time ----------------------------------------------------------------

    def check_add(self, name: str, hash_hex: str, tier: str) -> bytes:
        """The digest ``add`` would install; ``InvalidRequest`` if the key cannot be added."""
        if not _NAME.match(name):
            raise InvalidRequest("A key's name: 1-64 letters, digits, '.', '_', '@' or '-'.")
        if tier not in self._tiers:
            raise InvalidRequest(f"No tier {tier!r}; tiers: {', '.join(sorted(self._tiers))}.")
        m = _HEX.match(hash_hex.strip().lower())
        if m is None:
            raise InvalidRequest("A key's hash: sha256 as 64 hex digits, optionally 'sha256:...'.")
        digest = bytes.fromhex(m.group(1))
        held = self._by_hash.get(digest)
        if held is not None and held[1].id != f"key:{name}":
            raise InvalidRequest("Another key has this hash.")
        return digest

    def add(self, name: str, hash_hex: str, tier: str) -> dict[str, str]:
        """Add the key ``name`` (or replace its hash and tier: a rotation)."""
        digest = self.check_add(name, hash_hex, tier)
        self._drop(name)
        self._put(name, digest, tier, "runtime")
        return self.describe(name)

    def budget(self, name: str) -> Budget | None:
        if name not in self._by_name:
            raise NotFound(f"No key {name!r}.")
        return self._budgets.get(name)

    def set_budget(self, name: str, budget: Budget | None) -> dict[str, str]:
        """Give the key ``name`` a token budget (None: none)."""
        self.budget(name)  # 404 if unknown
        if budget is None:
            self._budgets.pop(name, None)
        else:
            self._budgets[name] = budget
        digest, tier, source = self._by_name[name]
        self._put(name, digest, tier, source)
        return self.describe(name)

    def revoke(self, name: str) -> dict[str, str]:
        """Refuse the key ``name`` from now on; ``NotFound`` if there is none."""
        if name not in self._by_name:
            raise NotFound(f"No key {name!r}.")
        gone = self.describe(name)
        self._drop(name)
        self._budgets.pop(name, None)
        return {**gone, "revoked": "true"}

    def _drop(self, name: str) -> None:
        held = self._by_name.pop(name, None)
        if held is not None:
            self._by_hash.pop(held[0], None)

    def describe(self, name: str) -> dict[str, str]:
        """A key as the admin API shows it: never more of its hash than a prefix."""
        digest, tier, source = self._by_name[name]
        return {"name": name, "tier": tier, "source": source, "hash": digest.hex()[:12]}

    def listing(self) -> list[dict[str, str]]:
        return [self.describe(name) for name in sorted(self._by_name)]

    def tier_of(self, name: str) -> str | None:
        held = self._by_name.get(name)
        return None if held is None else held[1]

    def state(self) -> dict[str, object]:
        """The run-time part: keys added or replaced, configured keys revoked."""
        added = {
            name: {"hash": digest.hex(), "tier": tier}
            for name, (digest, tier, source) in self._by_name.items()
            if source == "runtime"
        }
        revoked = sorted(set(self._configured) - set(self._by_name))
        budgets = {n: {"tokens": b.tokens, "counter": b.counter} for n, b in self._budgets.items()}
        return {"added": added, "revoked": revoked, "budgets": budgets}

    def restore(self, state: Mapping[str, object]) -> None:
        """Back to the configuration's keys, then ``state`` on them (unknown tiers left out)."""
        for name in list(self._by_name):
            self._drop(name)
        self._budgets.clear()
        budgets = state.get("budgets", {})
        for name, doc in (budgets if isinstance(budgets, dict) else {}).items():
            if isinstance(doc, dict):
                self._budgets[str(name)] = Budget(int(doc["tokens"]), str(doc["counter"]))
        for name, (digest, tier) in self._configured.items():
            self._put(name, digest, tier, "config")
        revoked = state.get("revoked", [])
        for name in revoked if isinstance(revoked, list) else []:
            self._drop(str(name))
        added = state.get("added", {})
        for name, doc in (added if isinstance(added, dict) else {}).items():
            if isinstance(doc, dict) and doc.get("tier") in self._tiers:
                self._drop(str(name))
                self._put(str(name), bytes.fromhex(str(doc["hash"])), str(doc["tier"]), "runtime")

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
