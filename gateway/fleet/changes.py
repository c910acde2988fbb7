"""What the fleet's change log holds, as values: a change, its position, a snapshot.

Pure: no I/O. ``gateway.fleet.log`` keeps these on Redis.

A **position** is the Redis Stream id the log gave a change (``<ms>-<seq>``): positions are
totally ordered, and every replica applies changes in that order. A **change** is one admin
action as a replica accepted it: the request that makes it (method, path, body), so that every
replica applies it through the same handler, plus who made it, where and when, and what it
changed (``old`` and ``new``, the audit trail). A **snapshot** is the fleet's state as of a
position: the log's entries up to it can then go (compaction), and a replica that was cut off
for longer starts from the snapshot and applies what follows it.

Every change has an **id** (the caller's ``Idempotency-Key``, or one the gateway made) and the
**fingerprint** of the request that made it: a call repeated with the same key finds the change
the first one made instead of making another, and one that reuses a key for another request is
told so. A snapshot keeps the ids of the changes it covers (``Snapshot.ids``, the last
``KEPT_IDS``), so that what a change became can still be told after the log was compacted, or
written back after it was lost (``gateway.fleet.epoch``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Final

from backends.errors import InvalidRequest

KEPT_IDS: Final = 1024  # the ids a replica (and a snapshot) remembers, newest kept
_ID: Final = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def change_id(given: str | None) -> str:
    """The id of a change: ``given`` (an ``Idempotency-Key``) when it is one, else a new one.
    ``InvalidRequest`` for a key that cannot be an id."""
    if given is None:
        return "chg_" + secrets.token_hex(12)
    if not _ID.match(given):
        raise InvalidRequest(
            "Idempotency-Key: 1 to 128 characters of letters, digits and '_.:-'.",
            param="Idempotency-Key",
        )
    return given


def fingerprint(method: str, path: str, body: bytes) -> str:
    """What identifies the request that made a change (a repeat must be the same request)."""
    digest = hashlib.sha256(f"{method} {path}\n".encode() + body).hexdigest()
    return digest[:32]


@dataclass(frozen=True, slots=True, order=True)
class Position:
    """A change's place in the log (a Redis Stream id)."""

    ms: int
    seq: int = 0

    @classmethod
    def parse(cls, text: str | bytes) -> Position:
        raw = text.decode() if isinstance(text, bytes) else text
        ms, sep, seq = raw.partition("-")
        try:
            position = cls(int(ms), int(seq) if sep else 0)
        except ValueError:
            raise InvalidRequest(f"not a change-log position: {raw!r}") from None
        if position.ms < 0 or position.seq < 0:
            raise InvalidRequest(f"not a change-log position: {raw!r}")
        return position

    def next(self) -> Position:
        """The smallest position after this one (``XTRIM MINID`` keeps from there)."""
        return Position(self.ms, self.seq + 1)

    def __str__(self) -> str:
        return f"{self.ms}-{self.seq}"


@dataclass(frozen=True, slots=True)
class Change:
    """One admin change: the request every replica applies, and the audit trail's facts."""

    method: str
    path: str  # with its query string
    body: bytes = b""
    content_type: str = "application/json"
    replica: str = ""  # the replica whose admin API accepted it
    caller: str = ""  # who asked (a name, never a credential)
    at: float = 0.0  # when it was accepted (Unix time, the accepting replica's clock)
    old: Any = None  # what it replaced, as the accepting replica saw it
    new: Any = None  # what it set
    labels: dict[str, str] = field(default_factory=dict)
    id: str = ""  # its id (an Idempotency-Key, or made by the gateway); "" in older entries
    fingerprint: str = ""  # of the request that made it

    def encode(self) -> dict[str, str]:
        """The fields of its log entry."""
        doc = {
            "id": self.id,
            "fingerprint": self.fingerprint,
            "method": self.method,
            "path": self.path,
            "body": base64.b64encode(self.body).decode(),
            "content_type": self.content_type,
            "replica": self.replica,
            "caller": self.caller,
            "at": self.at,
            "old": self.old,
            "new": self.new,
            "labels": self.labels,
        }
        return {"change": json.dumps(doc, separators=(",", ":"), sort_keys=True)}

    @classmethod
    def decode(cls, fields: dict[bytes, bytes] | dict[str, str]) -> Change:
        """From a log entry's fields; one this version cannot read raises ``InvalidRequest``."""
        by_name = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
        try:
            doc = json.loads(by_name["change"])
            return cls(
                method=str(doc["method"]),
                path=str(doc["path"]),
                body=base64.b64decode(doc["body"], validate=True),
                content_type=str(doc["content_type"]),
                replica=str(doc["replica"]),
                caller=str(doc["caller"]),
                at=float(doc["at"]),
                old=doc.get("old"),
                new=doc.get("new"),
                labels={str(k): str(v) for k, v in doc.get("labels", {}).items()},
                id=str(doc.get("id", "")),
                fingerprint=str(doc.get("fingerprint", "")),
            )
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise InvalidRequest(f"an unreadable change-log entry: {exc}") from None

    def describe(self, position: Position) -> dict[str, Any]:
        """The audit trail's view (the body left out: it may be large; never a secret)."""
        return {
            "position": str(position),
            "id": self.id,
            "method": self.method,
            "path": self.path,
            "replica": self.replica,
            "caller": self.caller,
            "at": self.at,
            "old": self.old,
            "new": self.new,
        }


@dataclass(frozen=True, slots=True)
class Known:
    """A change's id as the log knows it: where it is, and the request that made it."""

    position: Position
    fingerprint: str

    def encode(self) -> str:
        return f"{self.position}:{self.fingerprint}"

    @classmethod
    def decode(cls, text: str | bytes) -> Known:
        raw = text.decode() if isinstance(text, bytes) else text
        position, _, fp = raw.partition(":")
        return cls(Position.parse(position), fp)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The fleet's state once every change up to ``position`` was applied, and the ids of the
    last changes it covers."""

    position: Position
    state: dict[str, Any]
    ids: dict[str, Known] = field(default_factory=dict)

    def encode(self) -> str:
        return json.dumps(self.state, separators=(",", ":"), sort_keys=True)

    def encode_ids(self) -> str:
        return json.dumps({k: v.encode() for k, v in self.ids.items()}, separators=(",", ":"))

    @classmethod
    def decode(
        cls, position: str | bytes, state: str | bytes, ids: str | bytes | None = None
    ) -> Snapshot:
        try:
            doc = json.loads(state)
            known = json.loads(ids) if ids else {}
            by_id = {str(k): Known.decode(str(v)) for k, v in dict(known).items()}
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"an unreadable change-log snapshot: {exc}") from None
        if not isinstance(doc, dict):
            raise InvalidRequest("an unreadable change-log snapshot: not an object")
        return cls(Position.parse(position), doc, by_id)


@dataclass(frozen=True, slots=True)
class Batch:
    """What a replica at some position applies next: the snapshot first where it is behind
    it (the entries it missed are gone), then the entries, in order; and what the log is as
    read with them: its epoch (None: it has none, ``gateway.fleet.epoch``), its head (the last
    position it holds, or its snapshot's; None: it holds nothing)."""

    snapshot: Snapshot | None
    entries: list[tuple[Position, Change]]
    epoch: str | None = None
    head: Position | None = None

    @property
    def last(self) -> Position | None:
        """The position once the batch is applied; None when it holds nothing."""
        if self.entries:
            return self.entries[-1][0]
        return self.snapshot.position if self.snapshot is not None else None


def behind(snapshot: Snapshot | None, applied: Position | None) -> bool:
    """Whether a replica that applied up to ``applied`` must start from ``snapshot``."""
    return snapshot is not None and (applied is None or applied < snapshot.position)
