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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final

from backends.errors import AuthenticationError, InvalidRequest, NotFound
from gateway.limits.budget import Budget, iso
from gateway.limits.settings import KeySettings, LimitsSettings, TierSettings
from gateway.limits.store import Limits

ANONYMOUS: Final = "anonymous"
_NAME: Final = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")
_HEX: Final = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")
_LABEL: Final = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_MAX_LABELS: Final = 16
_LABEL_CHARS: Final = 256


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
    budget: Budget | None = None
    priority: int = 0  # its requests' priority when they do not ask (its tier's)
    own_engine_priority: bool = False  # it may set vLLM's priority itself
    max_wait: float | None = None  # the longest it may wait in the admission queue (its tier's)


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


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One key in force: its hash (never the key), tier, where it came from (``config`` or
    ``runtime``), labels, expiry, its own budget, and after a rotation the hash it replaced,
    honoured until ``previous_until``."""

    name: str
    digest: bytes
    tier: str
    source: str
    labels: Mapping[str, str] = field(default_factory=dict)
    expires_at: float | None = None  # Unix time
    budget: Budget | None = None
    previous: bytes | None = None
    previous_until: float | None = None
    limits: Mapping[str, int] = field(default_factory=dict)  # over its tier's (LIMIT_FIELDS)

    def to_json(self) -> dict[str, Any]:
        """Its run-time state (a snapshot's): the full hashes, never a key."""
        return {
            "hash": self.digest.hex(),
            "tier": self.tier,
            "source": self.source,
            "labels": dict(self.labels),
            "expires_at": self.expires_at,
            "budget": None if self.budget is None else self.budget.to_json(),
            "previous": None if self.previous is None else self.previous.hex(),
            "previous_until": self.previous_until,
            "limits": dict(self.limits),
        }

    @classmethod
    def from_json(cls, name: str, doc: Mapping[str, Any]) -> KeyRecord:
        budget = doc.get("budget")
        previous = doc.get("previous")
        return cls(
            name=name,
            digest=bytes.fromhex(str(doc["hash"])),
            tier=str(doc["tier"]),
            source=str(doc.get("source", "runtime")),
            labels={str(k): str(v) for k, v in (doc.get("labels") or {}).items()},
            expires_at=_float_or_none(doc.get("expires_at")),
            budget=None if not budget else Budget.from_json(budget),
            previous=None if previous is None else bytes.fromhex(str(previous)),
            previous_until=_float_or_none(doc.get("previous_until")),
            limits={str(k): int(v) for k, v in (doc.get("limits") or {}).items()},
        )


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


LIMIT_FIELDS: Final = ("requests_per_minute", "tokens_per_minute", "max_concurrent")


def check_limits(limits: Any) -> dict[str, int]:
    """A key's own limits, over its tier's: any of ``LIMIT_FIELDS``, positive whole numbers."""
    if not isinstance(limits, dict) or set(limits) - set(LIMIT_FIELDS):
        raise InvalidRequest(f"limits: an object of any of {', '.join(LIMIT_FIELDS)}.")
    for k, v in limits.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InvalidRequest(f"limits.{k}: a positive whole number.")
    return dict(limits)


def check_labels(labels: Any) -> dict[str, str]:
    """A key's labels: at most 16, names and values short text."""
    if not isinstance(labels, dict) or len(labels) > _MAX_LABELS:
        raise InvalidRequest(f"labels: an object of at most {_MAX_LABELS} names and values.")
    out: dict[str, str] = {}
    for k, v in labels.items():
        if not isinstance(v, str | int | float) or isinstance(v, bool):
            raise InvalidRequest(f"labels.{k}: a string.")
        if not _LABEL.match(str(k)) or len(str(v)) > _LABEL_CHARS:
            raise InvalidRequest(
                f"labels: names of 1-64 letters, digits, '.', '_' or '-'; values of at most "
                f"{_LABEL_CHARS} characters ({k!r})."
            )
        out[str(k)] = str(v)
    return out


class Authenticator:
    """The keys in force: the configuration's, plus those added and less those revoked at run
    time (through the admin API, and in a fleet through its change log: ``state``/``restore``
    carry the run-time part in a snapshot). ``clock``: Unix time, for expiry and rotation."""

    def __init__(self, settings: LimitsSettings, clock: Callable[[], float] = time.time) -> None:
        self.required = settings.auth
        self._tiers = settings.tiers
        self._clock = clock
        self._by_hash: dict[bytes, tuple[KeyRecord, Principal]] = {}
        self._keys: dict[str, KeyRecord] = {}
        self._configured = {k.name: _configured(k) for k in settings.keys}
        for record in self._configured.values():
            self._put(record)
        # With auth on, the anonymous tier serves nobody and need not exist.
        anon = settings.tiers.get(settings.anonymous_tier) or TierSettings()
        self.anonymous = Principal(
            id=ANONYMOUS,
            tier=settings.anonymous_tier,
            limits=_limits(anon),
            max_priority=anon.max_priority,
            authenticated=False,
            objective=anon.objective,
            budget=_tier_budget(anon),
            priority=min(anon.priority, anon.max_priority),
            own_engine_priority=anon.own_engine_priority,
            max_wait=anon.max_wait,
        )

    def _put(self, record: KeyRecord) -> None:
        tier = self._tiers[record.tier]
        principal = Principal(
            id=f"key:{record.name}",
            tier=record.tier,
            limits=replace(_limits(tier), **record.limits),
            max_priority=tier.max_priority,
            authenticated=True,
            objective=tier.objective,
            budget=record.budget if record.budget is not None else _tier_budget(tier),
            priority=min(tier.priority, tier.max_priority),
            own_engine_priority=tier.own_engine_priority,
            max_wait=tier.max_wait,
        )
        self._drop(record.name)
        self._keys[record.name] = record
        self._by_hash[record.digest] = (record, principal)
        if record.previous is not None:
            self._by_hash[record.previous] = (record, principal)

    def _drop(self, name: str) -> None:
        held = self._keys.pop(name, None)
        if held is not None:
            self._by_hash.pop(held.digest, None)
            if held.previous is not None:
                self._by_hash.pop(held.previous, None)

    def _record(self, name: str) -> KeyRecord:
        record = self._keys.get(name)
        if record is None:
            raise NotFound(f"No key {name!r}.")
        return record

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
        if held is not None and held[0].name != name:
            raise InvalidRequest("Another key has this hash.")
        return digest

    def add(
        self,
        name: str,
        hash_hex: str,
        tier: str,
        *,
        labels: Mapping[str, str] | None = None,
        expires_at: float | None = None,
        budget: Budget | None = None,
        limits: Mapping[str, int] | None = None,
    ) -> dict[str, Any]:
        """Add the key ``name`` (or replace it whole, its previous secret refused at once);
        ``limits``: its own, over its tier's (``LIMIT_FIELDS``)."""
        digest = self.check_add(name, hash_hex, tier)
        record = KeyRecord(name, digest, tier, "runtime", dict(labels or {}), expires_at, budget)
        self._put(replace(record, limits=dict(limits or {})))
        return self.describe(name)

    def check_rotate(self, name: str, hash_hex: str) -> bytes:
        return self.check_add(name, hash_hex, self._record(name).tier)

    def rotate(self, name: str, hash_hex: str, overlap_until: float) -> dict[str, Any]:
        """A new secret for ``name``; the one it replaces is honoured until ``overlap_until``
        (Unix time, decided where the change was made, so every replica agrees)."""
        digest = self.check_rotate(name, hash_hex)
        old = self._record(name)
        self._put(
            replace(
                old, digest=digest, source="runtime", previous=old.digest,
                previous_until=overlap_until,
            )
        )  # fmt: skip
        return self.describe(name)

    def budget(self, name: str) -> Budget | None:
        """The budget ``name``'s requests are charged to: its own, else its tier's."""
        entry = self._by_hash[self._record(name).digest]
        return entry[1].budget

    def set_budget(self, name: str, budget: Budget | None) -> dict[str, Any]:
        """Give the key ``name`` its own token budget (None: its tier's, if any)."""
        self._put(replace(self._record(name), budget=budget))
        return self.describe(name)

    def revoke(self, name: str) -> dict[str, Any]:
        """Refuse the key ``name`` from now on; ``NotFound`` if there is none."""
        gone = self.describe(name)
        self._drop(name)
        return {**gone, "revoked": True}

    def describe(self, name: str) -> dict[str, Any]:
        """A key as the admin API shows it: never more of its hash than a prefix."""
        r = self._record(name)
        doc: dict[str, Any] = {
            "name": name,
            "tier": r.tier,
            "source": r.source,
            "hash": r.digest.hex()[:12],
            "labels": dict(r.labels),
            "expires_at": None if r.expires_at is None else iso(r.expires_at),
            "limits": dict(r.limits),
        }
        if r.previous is not None and r.previous_until is not None:
            doc["previous_until"] = iso(r.previous_until)
        return doc

    def principal_ids(self) -> list[str]:
        """Every principal a request can be counted under now: anonymous, then each key."""
        return [ANONYMOUS, *(f"key:{name}" for name in sorted(self._keys))]

    def listing(self) -> list[dict[str, Any]]:
        return [self.describe(name) for name in sorted(self._keys)]

    def records(self) -> dict[str, dict[str, Any]]:
        """Every key in force, as its record's JSON (full hashes, never a key)."""
        return {name: r.to_json() for name, r in sorted(self._keys.items())}

    def tier_of(self, name: str) -> str | None:
        held = self._keys.get(name)
        return None if held is None else held.tier

    def state(self) -> dict[str, object]:
        """The run-time part: keys added or changed, configured keys revoked."""
        changed = {
            name: r.to_json()
            for name, r in self._keys.items()
            if r.source == "runtime" or r != self._configured.get(name)
        }
        revoked = sorted(set(self._configured) - set(self._keys))
        return {"added": changed, "revoked": revoked}

    def restore(self, state: Mapping[str, object]) -> None:
        """Back to the configuration's keys, then ``state`` on them (unknown tiers left out)."""
        for name in list(self._keys):
            self._drop(name)
        for record in self._configured.values():
            self._put(record)
        revoked = state.get("revoked", [])
        for name in revoked if isinstance(revoked, list) else []:
            self._drop(str(name))
        added = state.get("added", {})
        for name, doc in (added if isinstance(added, dict) else {}).items():
            if isinstance(doc, dict) and doc.get("tier") in self._tiers:
                self._put(KeyRecord.from_json(str(name), doc))

    # -- per request ------------------------------------------------------------------------

    def lookup(self, key: str) -> Principal | None:
        digest = hashlib.sha256(key.encode()).digest()
        entry = self._by_hash.get(digest)
        if entry is None:
            return None
        record, principal = entry
        matched = record.digest if digest == record.digest else record.previous
        if matched is None or not hmac.compare_digest(matched, digest):
            return None
        if record.expires_at is not None and self._clock() >= record.expires_at:
            raise AuthenticationError(
                f"This API key expired at {iso(record.expires_at)}.", code="expired_api_key"
            )
        if matched is not record.digest and (
            record.previous_until is None or self._clock() >= record.previous_until
        ):
            return None  # a rotated secret past its overlap: as any unknown key
        return principal

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


def _tier_budget(tier: TierSettings) -> Budget | None:
    if tier.tokens_per_day is None and tier.tokens_per_month is None:
        return None
    return Budget(tier.tokens_per_day, tier.tokens_per_month, source="tier")


def _configured(k: KeySettings) -> KeyRecord:
    budget = Budget(k.tokens_per_day, k.tokens_per_month)
    return KeyRecord(
        name=k.name,
        digest=bytes.fromhex(k.hash),
        tier=k.tier,
        source="config",
        labels=dict(k.labels),
        expires_at=None if k.expires_at is None else k.expires_at.timestamp(),
        budget=None if budget.empty else budget,
        limits={str(name): n for name, n in k.limits.items()},
    )
