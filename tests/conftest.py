"""Markers given by folder, and the Redis fixtures: the machine's Redis (or one started here),
a key prefix per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.redis_server import RedisServer, ping

_DEFAULT_PORT = 6379

_TESTS = Path(__file__).parent
# What a folder needs that `make check` does not install: the marker that deselects it there.
_FOLDER_MARKERS = {
    _TESTS / "e2e": "vllm",
    _TESTS / "compose": "compose",
    _TESTS / "gateway" / "admin" / "console": "browser",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for folder, marker in _FOLDER_MARKERS.items():
            if item.path.is_relative_to(folder):
                item.add_marker(marker)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """127.0.0.1:6379 if it answers; else a redis-server started for the session; else fail."""
    if ping(_DEFAULT_PORT):
        yield f"redis://127.0.0.1:{_DEFAULT_PORT}/0"
        return
    server = RedisServer()
    server.start()  # fails the test with instructions when redis-server is not installed
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix no other test uses; afterwards exactly its keys are deleted."""
    yield from _own_prefix(redis_url)


@pytest.fixture(scope="module")
def module_redis_prefix(redis_url: str) -> Iterator[str]:
    """``redis_prefix`` for a module's shared fixture."""
    yield from _own_prefix(redis_url)


def _own_prefix(redis_url: str) -> Iterator[str]:
    prefix = f"test-limits:{uuid.uuid4().hex}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A private redis-server the test may stop and restart."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
