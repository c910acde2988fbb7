"""Small test helpers that need nothing from the app (so these tests import only the limits)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any


async def wait_for(
    predicate: Callable[[], bool], *, within: float = 5.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` until true; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.002)  # sleep-ok: polling interval of a deadline-bounded wait


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chat_chunk(
    content: str | None = None, *, role: bool = False, finish: str | None = None
) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta = {"content": content}
    return sse(
        {
            "id": "chatcmpl-x",
            "object": "chat.completion.chunk",
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
    )
