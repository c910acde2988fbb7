"""Without a fleet, the admin changes made here remembered by id (``Idempotency-Key``), so a
repeated call is answered as the first was (``gateway.admin.fleet``)."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Final

from backends.errors import IdempotencyKeyReused

IDEMPOTENCY_HEADER: Final = "Idempotency-Key"
_KEPT_REPLAYS: Final = 1024
_REPLAY_S: Final = 86_400.0


class Replays:
    """Without a fleet: the answers of the last changes made here, by id, for a day, so that a
    repeated call is answered as the first was."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, tuple[float, str, int, bytes]] = OrderedDict()

    def get(self, cid: str, fp: str | None) -> tuple[int, bytes] | None:
        """The first answer for ``cid``; ``fp`` None: whatever request made it."""
        kept = self._kept.get(cid)
        if kept is None or time.time() - kept[0] > _REPLAY_S:
            return None
        if fp is not None and kept[1] != fp:
            raise IdempotencyKeyReused(
                f"Idempotency-Key {cid!r} was used for another request; use a new key for a "
                "new change.",
                param=IDEMPOTENCY_HEADER,
            )
        return kept[2], kept[3]

    def put(self, cid: str, fp: str, status: int, body: bytes) -> None:
        self._kept[cid] = (time.time(), fp, status, body)
        while len(self._kept) > _KEPT_REPLAYS:
            self._kept.popitem(last=False)
