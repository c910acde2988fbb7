"""The Responses API's affinity: which backend holds each stored response.

vLLM keeps a stored response (``store``, the default) in the memory of the server that made it,
so ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and a request naming it as
``previous_response_id`` must reach that server. The gateway names every response itself (it
sets vLLM's ``request_id``, which vLLM takes as the response's id, unless the client did), so
it knows the id before the backend answers, and remembers ``id -> backend`` once the backend
has said 200. The memory is bounded: the newest ``capacity`` ids in this process, and with
``store = "redis"`` every replica's, for ``ttl`` seconds, in the limits' Redis. A Redis that
cannot be reached costs the shared view, never the request: the local memory still answers.
With ``serve --workers`` and the memory store, a worker that does not know an id asks the
other workers (``PeerHomes``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, Protocol
from urllib.parse import urlencode

import structlog
from aiohttp import web
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.config.settings import ResponsesSettings
from gateway.limits.settings import RedisSettings
from gateway.request.body import with_field
from gateway.workers.supervisor import ask_peer

log = structlog.get_logger("gateway.request.responses")

MAX_ID_CHARS: Final = 256  # vLLM takes any string; a longer one is not remembered


def with_response_id(doc: dict[str, Any], raw: bytes) -> tuple[str, dict[str, Any], bytes]:
    """The response's id (the client's ``request_id``, else a new one) and the body that
    names it; a new id is appended to the raw body, so a long input is not serialised again."""
    given = doc.get("request_id")
    if isinstance(given, str) and given:
        return given, doc, raw
    rid = f"resp_{uuid.uuid4().hex}"
    return rid, {**doc, "request_id": rid}, with_field(doc, raw, "request_id", rid)


class ResponseHomes(Protocol):
    async def remember(self, response_id: str, backend: str) -> None: ...

    async def home(self, response_id: str) -> str | None: ...

    async def close(self) -> None: ...


class MemoryHomes:
    """The newest ``capacity`` ids of this process, each with its backend."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._homes: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    async def remember(self, response_id: str, backend: str) -> None:
        self.put(response_id, backend)

    def put(self, response_id: str, backend: str) -> None:
        if len(response_id) > MAX_ID_CHARS:
            return
        self._homes[response_id] = backend
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)

    async def home(self, response_id: str) -> str | None:
        return self._homes.get(response_id)

    async def close(self) -> None:
        return None


class RedisHomes:
    """Shared by every replica through Redis (keys expire after ``ttl``), the local memory
    in front: what this replica made is found without Redis, and found when Redis is down."""

    def __init__(self, client: Redis, *, prefix: str, ttl: float, local: MemoryHomes) -> None:
        self._client = client
        self._prefix = prefix
        self._ttl_ms = max(1, int(ttl * 1000))
        self.local = local
        self._down_since: float | None = None

    def _key(self, response_id: str) -> str:
        return f"{self._prefix}resp:{response_id}"

    def _failed(self, exc: RedisError) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("responses_store_unavailable", error=str(exc), effect="local memory only")

    def _ok(self) -> None:
        if self._down_since is not None:
            log.info(
                "responses_store_recovered", down_s=round(time.monotonic() - self._down_since, 1)
            )
            self._down_since = None

    async def remember(self, response_id: str, backend: str) -> None:
        if len(response_id) > MAX_ID_CHARS:
            return
        self.local.put(response_id, backend)
        try:
            await self._client.set(self._key(response_id), backend, px=self._ttl_ms)
        except RedisError as exc:
            self._failed(exc)
        else:
            self._ok()

    async def home(self, response_id: str) -> str | None:
        found = await self.local.home(response_id)
        if found is not None or len(response_id) > MAX_ID_CHARS:
            return found
        try:
            value = await self._client.get(self._key(response_id))
        except RedisError as exc:
            self._failed(exc)
            return None
        self._ok()
        if value is None:
            return None
        backend = value.decode() if isinstance(value, bytes) else str(value)
        self.local.put(response_id, backend)
        return backend

    async def close(self) -> None:
        await self._client.aclose()


class PeerHomes:
    """This worker's memory, then its peers' (``serve --workers`` with the memory store): a
    follow-up the kernel hands to another worker than the one that saw the response made
    asks the others over their private sockets (``peer_home``), and remembers the answer."""

    def __init__(self, local: MemoryHomes, peers: Sequence[Path]) -> None:
        self.local = local
        self._peers = list(peers)

    async def remember(self, response_id: str, backend: str) -> None:
        self.local.put(response_id, backend)

    async def home(self, response_id: str) -> str | None:
        found = await self.local.home(response_id)
        if found is not None or len(response_id) > MAX_ID_CHARS:
            return found
        answers = await asyncio.gather(*(_ask(p, response_id) for p in self._peers))
        found = next((a for a in answers if a is not None), None)
        if found is not None:
            self.local.put(response_id, found)
        return found

    async def close(self) -> None:
        return None


_PEER_TIMEOUT_S: Final = 1.0


async def _ask(socket: Path, response_id: str) -> str | None:
    answer = await ask_peer(
        socket, "GET", f"/responses/home?{urlencode({'id': response_id})}", within=_PEER_TIMEOUT_S
    )
    if isinstance(answer, str) or answer[0] != 200:
        return None
    try:
        backend = json.loads(answer[1]).get("backend")
    except (ValueError, AttributeError):
        return None
    return backend if isinstance(backend, str) else None


async def peer_home(request: web.Request, homes: ResponseHomes) -> web.Response:
    """A worker's private answer: the backend it remembers for ``?id=`` (404: none)."""
    rid = request.query.get("id", "")
    own = homes.local if isinstance(homes, PeerHomes) else homes  # this worker's: no asking back
    backend = await own.home(rid) if rid else None
    if backend is None:
        return web.json_response({"backend": None}, status=404)
    return web.json_response({"backend": backend})


def open_homes(
    settings: ResponsesSettings, redis: RedisSettings, peers: Sequence[Path] = ()
) -> ResponseHomes:
    """``peers``: the other workers' private sockets, asked when the memory store misses."""
    local = MemoryHomes(settings.capacity)
    if settings.store == "memory":
        return PeerHomes(local, peers) if peers else local
    client = Redis.from_url(
        redis.url.get_secret_value(),
        socket_timeout=redis.timeout,
        socket_connect_timeout=redis.timeout,
        retry=Retry(NoBackoff(), 0),  # a lookup that fails falls back to this process's memory
    )
    prefix = redis.key_prefix.removesuffix("limits:") + "responses:"
    return RedisHomes(client, prefix=prefix, ttl=settings.ttl, local=local)
