"""A client of the tests' Redis for the fleet's tests (each test under its own key prefix)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url, socket_timeout=5.0)
    try:
        yield client
    finally:
        await client.aclose()
