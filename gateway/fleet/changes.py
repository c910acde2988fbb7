"""What the fleet's change log holds, as values: a change, its position, a snapshot.

Pure: no I/O. ``gateway.fleet.log`` keeps these on Redis.

A **position** is the Redis Stream id the log gave a change (``<ms>-<seq>``): positions are
totally ordered, and every replica applies changes in that order. A **change** is one admin
action as a replica accepted it: the request that makes it (method, path, body), so that every
replica applies it through the same handler, plus who made it, where and when, and what it
changed (``old`` and ``new``, the audit trail). A **snapshot** is the fleet's state as of a
position: the log's entries up to it can then go (compaction), and a replica that was cut off
for longer starts from the snapshot and applies what follows it.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from backends.errors import InvalidRequest


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

    def encode(self) -> dict[str, str]:
        """The fields of its log entry."""
        doc = {
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
            )
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise InvalidRequest(f"an unreadable change-log entry: {exc}") from None

    def describe(self, position: Position) -> dict[str, Any]:
        """The audit trail's view (the body left out: it may be large; never a secret)."""
        return {
            "position": str(position),
            "method": self.method,
            "path": self.path,
            "replica": self.replica,
            "caller": self.caller,
            "at": self.at,
            "old": self.old,
            "new": self.new,
        }


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The fleet's state once every change up to ``position`` was applied."""

    position: Position
    state: dict[str, Any]

    def encode(self) -> str:
        return json.dumps(self.state, separators=(",", ":"), sort_keys=True)

    @classmethod
    def decode(cls, position: str | bytes, state: str | bytes) -> Snapshot:
        try:
            doc = json.loads(state)
        except ValueError as exc:
            raise InvalidRequest(f"an unreadable change-log snapshot: {exc}") from None
        if not isinstance(doc, dict):
            raise InvalidRequest("an unreadable change-log snapshot: not an object")
        return cls(Position.parse(position), doc)


@dataclass(frozen=True, slots=True)
class Batch:
    """What a replica at some position applies next: the snapshot first where it is behind
    it (the entries it missed are gone), then the entries, in order."""

    snapshot: Snapshot | None
    entries: list[tuple[Position, Change]]

    @property
    def last(self) -> Position | None:
        """The position once the batch is applied; None when it holds nothing."""
        if self.entries:
            return self.entries[-1][0]
        return self.snapshot.position if self.snapshot is not None else None


def behind(snapshot: Snapshot | None, applied: Position | None) -> bool:
    """Whether a replica that applied up to ``applied`` must start from ``snapshot``."""
    return snapshot is not None and (applied is None or applied < snapshot.position)
