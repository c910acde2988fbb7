"""The admin changes the workers of ``serve --workers`` have applied, numbered, in order.

Worker 0 is where every change starts: it numbers each one it applied (``append``) before it
sends it on to the other workers (``gateway.admin.fanout``), who take them in that order
(``take``). Every worker keeps the same journal, so a worker started again after it died asks
the others for theirs and replays what it lacks before it takes traffic, and a worker that
missed a change (it was being restarted, or too slow to answer) fetches it before the next.

Pure bookkeeping, no I/O. Bounded: the oldest entries go once there are ``max_entries`` of
them or their bodies pass ``max_bytes``; a worker that needs one of those is told how many
it cannot have (``Fetched.missing``), and its replay is partial (logged as such).
"""

from __future__ import annotations

import base64
from collections import deque
from dataclasses import dataclass
from typing import Any, Final

MAX_ENTRIES: Final = 1024
MAX_BYTES: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class Entry:
    """One admin change as it came to worker 0: what a worker replays to apply it again.
    Its credentials are not kept: a replay carries the replaying worker's own token."""

    seq: int
    method: str
    path_qs: str
    content_type: str
    body: bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "method": self.method,
            "path": self.path_qs,
            "content_type": self.content_type,
            "body": base64.b64encode(self.body).decode(),
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Entry:
        return cls(
            int(doc["seq"]),
            str(doc["method"]),
            str(doc["path"]),
            str(doc["content_type"]),
            base64.b64decode(doc["body"]),
        )


@dataclass(frozen=True, slots=True)
class Fetched:
    """A peer's entries after some ``seq``: ``missing`` of those wanted were dropped there."""

    entries: list[Entry]
    last: int
    missing: int = 0


class AdminJournal:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: deque[Entry] = deque()
        self._bytes = 0
        self.last = 0  # the highest change applied (or let go: ``skip_to``) here

    def append(self, method: str, path_qs: str, content_type: str, body: bytes) -> Entry:
        """A change worker 0 applied: the next number is its."""
        entry = Entry(self.last + 1, method, path_qs, content_type, body)
        self.take(entry)
        return entry

    def due(self, seq: int) -> bool | None:
        """Whether change ``seq`` is the next to apply here: True; already here: None;
        False: one before it is missing."""
        if seq <= self.last:
            return None
        return seq == self.last + 1

    def take(self, entry: Entry) -> None:
        """``entry`` is (being) applied here: the next one due is the one after it."""
        self.last = max(self.last, entry.seq)
        self._entries.append(entry)
        self._bytes += len(entry.body)
        while self._entries and (
            len(self._entries) > self.max_entries or self._bytes > self.max_bytes
        ):
            self._bytes -= len(self._entries.popleft().body)

    def skip_to(self, seq: int) -> None:
        """Changes up to ``seq`` are beyond reach (dropped everywhere): go on after them."""
        self.last = max(self.last, seq)

    def after(self, seq: int) -> Fetched:
        """What a worker that has everything up to ``seq`` lacks, as far as this journal
        still holds it."""
        entries = [e for e in self._entries if e.seq > seq]
        first = entries[0].seq if entries else self.last + 1
        return Fetched(entries, self.last, missing=max(0, first - seq - 1))

    def to_json(self, seq: int) -> dict[str, Any]:
        fetched = self.after(seq)
        return {
            "entries": [e.to_json() for e in fetched.entries],
            "last": fetched.last,
            "missing": fetched.missing,
        }

    @staticmethod
    def from_json(doc: dict[str, Any]) -> Fetched:
        return Fetched(
            [Entry.from_json(e) for e in doc["entries"]], int(doc["last"]), int(doc["missing"])
        )
