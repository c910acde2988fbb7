"""Fixtures and helpers for simulator tests: a fast in-process sim and an HTTP client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tools.sim import FAST, RunningSim, running_sim


@pytest.fixture
async def sim() -> AsyncIterator[RunningSim]:
    async with running_sim(FAST) as s:
        yield s


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def sse_events(raw: bytes) -> list[Any]:
    """The payloads of an SSE body: parsed JSON, or the string ``[DONE]``."""
    text = raw.decode()
    assert text.endswith("\n\n"), "an SSE body ends with a blank line"
    events: list[Any] = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_clean(sim: RunningSim) -> None:
    """Nothing left in the engine, and nothing counted as a success (every request aborted)."""
    assert not sim.engine.running
    assert not sim.engine.waiting
    assert sim.engine.pool.usage == 0.0
    assert sum(sim.engine.stats.request_success.values()) == 0


def chat_body(text: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": FAST.model_name, "messages": [{"role": "user", "content": text}], **extra}


def completion_body(prompt: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": FAST.model_name, "prompt": prompt, **extra}
