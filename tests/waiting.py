"""The one way tests wait: poll a condition with a deadline (never a bare sleep)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def wait_for(
    predicate: Callable[[], bool], *, within: float = 5.0, what: str = "condition"
) -> float:
    """Poll ``predicate`` until true; return when (monotonic). Fail after ``within`` s."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.002)  # sleep-ok: polling interval of a deadline-bounded wait
    return time.monotonic()
