"""The host's in-flight counts per backend, shared by the gateway's worker processes.

``llm-gateway serve --workers N`` runs N full gateways accepting on one port. Each one knows
its own requests in flight to each backend; the policies must see the host's, or a burst spread
over the workers piles onto one backend (each worker thinks it idle). This table, in shared
memory, holds one row per worker: ``SLOTS`` pairs of (backend key, count), the key a 63-bit
hash of the backend's id (open addressing within the row). A worker writes only its own row
(one aligned 8-byte store per change: no locks on the request path) and reads the others'
when it takes a snapshot; the supervisor clears the row of a worker that died, whose requests
died with it.

A row is a worker's own: a slot once given to a backend keeps it for the row's life (a row
fills only with ``SLOTS`` distinct backends in one worker's lifetime; past that, a backend's
count is this worker's alone and ``overflowed`` says so).
"""

from __future__ import annotations

import hashlib
from typing import Final

SLOTS: Final = 1024  # backends per row
_WORD: Final = 8
_ROW_WORDS: Final = 2 * SLOTS
_MEMO: Final = 4 * SLOTS  # backend ids whose keys and places a reader remembers


def backend_key(backend_id: str) -> int:
    """A backend's key in the table: non-zero (zero marks a free slot), below 2**63."""
    digest = hashlib.blake2b(backend_id.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 1) or 1


def table_bytes(workers: int) -> int:
    return workers * _ROW_WORDS * _WORD


class SharedInFlight:
    """One worker's handle on the table: ``set`` its own counts, ``others`` the rest's."""

    def __init__(self, buf: memoryview | None, workers: int, worker: int) -> None:
        """``buf``: the table's memory (a ``SharedMemory``'s ``buf``, shared by the workers)."""
        if buf is None:
            raise ValueError("the shared memory is closed")
        if not 0 <= worker < workers:
            raise ValueError("worker must be in [0, workers)")
        self._words = buf.cast("q")
        if len(self._words) < workers * _ROW_WORDS:
            raise ValueError("the buffer is smaller than the table")
        self.workers = workers
        self.worker = worker
        self._own: dict[str, int] = {}  # backend id -> word index of its count in our row
        self._seen: dict[tuple[int, str], int] = {}  # (row, backend id) -> word index found
        self._keys: dict[str, int] = {}
        self.overflowed = 0

    def set(self, backend_id: str, count: int) -> None:
        """This worker's requests in flight to ``backend_id`` are ``count``."""
        at = self._own.get(backend_id)
        if at is None:
            at = self._claim(backend_id)
            if at is None:
                return
        self._words[at] = count

    def others(self, backend_id: str) -> int:
        """The other workers' requests in flight to ``backend_id``."""
        key = self._keys.get(backend_id)
        if key is None:
            if len(self._keys) >= _MEMO:  # ids come and go (discovery): stay bounded
                self._keys.clear()
                self._seen.clear()
            key = self._keys[backend_id] = backend_key(backend_id)
        total = 0
        words = self._words
        for row in range(self.workers):
            if row == self.worker:
                continue
            at = self._seen.get((row, backend_id))
            if at is None or words[at - 1] != key:
                at = self._find(row, key, backend_id)
                if at is None:
                    continue
            total += words[at]
        return max(total, 0)

    def clear_row(self, worker: int) -> None:
        """Forget ``worker``'s counts (it died, and its requests with it)."""
        base = worker * _ROW_WORDS
        words = self._words
        for i in range(base, base + _ROW_WORDS):
            words[i] = 0
        if worker == self.worker:
            self._own.clear()

    def release(self) -> None:
        self._words.release()

    # -- open addressing within a row ------------------------------------------------------

    def _probe(self, row: int, key: int) -> range:
        start = key % SLOTS
        base = row * _ROW_WORDS
        return range(base + 2 * start, base + 2 * start + _ROW_WORDS, 2)

    def _claim(self, backend_id: str) -> int | None:
        key = backend_key(backend_id)
        words, base = self._words, self.worker * _ROW_WORDS
        for i in self._probe(self.worker, key):
            slot = base + (i - base) % _ROW_WORDS
            if words[slot] in (0, key):
                words[slot + 1] = 0
                words[slot] = key  # the key last: a reader never sees it with a stale count
                self._own[backend_id] = slot + 1
                return slot + 1
        self.overflowed += 1
        return None

    def _find(self, row: int, key: int, backend_id: str) -> int | None:
        words, base = self._words, row * _ROW_WORDS
        for i in self._probe(row, key):
            slot = base + (i - base) % _ROW_WORDS
            k = words[slot]
            if k == key:
                self._seen[(row, backend_id)] = slot + 1
                return slot + 1
            if k == 0:
                return None
        return None
