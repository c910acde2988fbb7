"""Gateway replicas as real processes sharing one Redis: the fleet as an operator runs it (or
one host's gateway without Redis, its change log in files: ``redis_url`` None).

Three fake backends (``a`` and ``b`` in pool ``stable``, ``c`` in pool ``canary``, the alias
``chat`` on stable; or three engines of the test's, e.g. simulators, serving ``m`` at the
URLs given) behind ``n`` replicas of ``llm-gateway serve``, each on its own ports, with one
admin token, the fleet's log on the test's Redis under the test's key prefix. Each replica
is started in its own process group (not its own session) and logs JSON on stderr, read here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from gateway.limits.keys import hash_key
from tests.redis_server import free_port
from tests.waiting import wait_for
from tools.fake_vllm import FakeBackend, running_fake

TOKEN = "fleet-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ALIAS = "chat"
OPS_KEY = "sk-ops-secret"  # the configured key when auth is on
T = TypeVar("T")


def chat(model: str = "m") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def toml_value(value: object) -> str:
    """``value`` as a TOML value (inline tables and arrays)."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)  # strings, numbers and booleans are written alike


def toml_key(key: object) -> str:
    """``key`` bare where TOML allows it, else quoted (a model name such as ``org/model``)."""
    text = str(key)
    return text if re.fullmatch(r"[A-Za-z0-9_-]+", text) else json.dumps(text)


def config(
    backends: dict[str, str],
    redis_url: str | None,
    prefix: str,
    *,
    auth: bool = False,
    files: Path | None = None,
    rollout: dict[str, object] | None = None,
    capacity: dict[str, object] | None = None,
    retry: dict[str, object] | None = None,
    health: dict[str, object] | None = None,
    **fleet: object,
) -> str:
    """With ``redis_url`` None, no Redis: the fleet's log in files under ``files``;
    ``rollout``: the ``[rollout]`` section's settings (progressive rollouts); ``capacity``:
    the ``[capacity]`` section's (the capacity manager); ``retry``: the ``[retry]`` section's
    (failover and its budget); ``health``: added to the fast probes' ``[health]``."""
    store = (
        f'store = "redis", redis = {{ url = "{redis_url}", key_prefix = "{prefix}", '
        + "timeout = 1.0 }"
        if redis_url is not None
        else 'store = "memory"'
    )
    where = ['log = "redis"'] if redis_url is not None else ['log = "files"', f'dir = "{files}"']
    if "wait" in fleet:
        where.append(f"wait = {json.dumps(fleet['wait'])}")
    lines = [
        'policy = "least_load"',
        "shutdown_grace = 5",
        f'admin = {{ token = "{TOKEN}" }}',
        "scrape = { interval = 0.1 }",
        f"health = {toml_value({'interval': 0.1, **(health or {})})}",
        "limits = { "
        + (
            f'auth = true, keys = [{{ name = "ops", hash = "{hash_key(OPS_KEY)}" }}], '
            if auth
            else ""
        )
        + store
        + " }",
        "fleet = { "
        + ", ".join(
            [
                *where,
                "report_interval = 0.5",
                "report_ttl = 3.0",
                # An answer waits for every replica, however slow the host: how soon they
                # apply a change is the benchmark's (loadtest/bench/fleet_changes.py).
                *([] if "wait" in fleet else ["wait = 15.0"]),
                *(f"{k} = {json.dumps(v)}" for k, v in fleet.items() if k != "wait"),
            ]
        )
        + " }",
        f"aliases = {{ {ALIAS} = {{ stable = 100, canary = 0 }} }}",
    ]
    if rollout:
        lines.append(f"rollout = {toml_value(rollout)}")
    if capacity:
        lines.append(f"capacity = {toml_value(capacity)}")
    if retry:
        lines.append(f"retry = {toml_value(retry)}")
    for name, url in backends.items():
        lines += ["[[backends]]", f'url = "{url}"', f'name = "{name}"']
    lines += [
        "[[pools]]",
        'name = "stable"',
        'model = "m"',
        'backends = ["a", "b"]',
        "[[pools]]",
        'name = "canary"',
        'model = "m"',
        'backends = ["c"]',
    ]
    return "\n".join(lines) + "\n"


@dataclass
class Replica:
    name: str
    config: Path
    port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    workers: int = 1  # serve --workers
    proc: asyncio.subprocess.Process | None = None
    logs: list[dict[str, Any]] = field(default_factory=list)
    _reader: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.logs if e.get("event") == name]

    async def start(self, *, wait: bool = True) -> None:
        """Start it (again, on the same ports); with ``wait``, until it listens."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env |= {
            "GATEWAY_LOG_FORMAT": "json",
            "GATEWAY_PORT": str(self.port),
            "GATEWAY_ADMIN__PORT": str(self.admin_port),
            "GATEWAY_FLEET__REPLICA": self.name,
            "GATEWAY_WORKERS": str(self.workers),
        }
        self.logs = []
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--config",
            str(self.config),
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            process_group=0,
        )
        self._reader = asyncio.create_task(self._read(self.proc))
        if wait:
            await self.listening()

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        async for line in proc.stderr:
            with contextlib.suppress(ValueError):
                self.logs.append(json.loads(line))

    async def listening(self) -> None:
        def up() -> bool:
            return len(self.events("gateway_listening")) >= self.workers or (
                self.proc is not None and self.proc.returncode is not None
            )

        await wait_for(up, within=30, what=f"{self.name} listening")
        assert self.proc is not None
        assert self.proc.returncode is None, self.logs[-10:]

    async def kill(self) -> None:
        """SIGKILL: gone at once, as a crashed replica is (it never leaves the registry)."""
        await self._end(signal.SIGKILL)

    async def stop(self) -> None:
        await self._end(signal.SIGTERM)

    async def _end(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:
            await asyncio.wait_for(self._reader, 5)
        self.proc = None


@dataclass
class Fleet:
    replicas: list[Replica]
    fakes: dict[str, FakeBackend]
    session: aiohttp.ClientSession

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.replicas)

    def __getitem__(self, i: int) -> Replica:
        return self.replicas[i]

    async def change(
        self, replica: Replica, method: str, path: str, body: Any = None, *, key: str | None = None
    ) -> tuple[int, dict[str, str], Any]:
        """An admin change through ``replica``; ``key``: its ``Idempotency-Key``."""
        headers = AUTH if key is None else {**AUTH, "Idempotency-Key": key}
        async with self.session.request(
            method, replica.admin + path, json=body, headers=headers
        ) as r:
            return r.status, dict(r.headers), await r.json()

    async def read(self, replica: Replica, path: str) -> Any:
        async with self.session.get(replica.admin + path, headers=AUTH) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def draining(self, replica: Replica) -> dict[str, bool]:
        doc = await self.read(replica, "/admin/backends")
        return {b["id"]: b["draining"] for b in doc["backends"]}

    async def alias(self, replica: Replica) -> dict[str, float]:
        weights: dict[str, float] = (await self.read(replica, f"/admin/aliases/{ALIAS}"))["weights"]
        return weights

    async def send(
        self, replica: Replica, n: int, model: str = "m", *, fresh_connections: bool = False
    ) -> dict[str, int]:
        """``n`` chat requests through ``replica``; which fake answered how many.
        ``fresh_connections``: each on its own (the kernel spreads them over the workers)."""
        before = {name: len(f.seen) for name, f in self.fakes.items()}
        url = replica.url + "/v1/chat/completions"
        for _ in range(n):
            if fresh_connections:
                async with (
                    aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
                    s.post(url, json=chat(model)) as r,
                ):
                    assert r.status == 200, await r.text()
                continue
            async with self.session.post(url, json=chat(model)) as r:
                assert r.status == 200, await r.text()
        return {name: len(f.seen) - before[name] for name, f in self.fakes.items()}

    async def status_with(self, replica: Replica, key: str) -> int:
        """A chat request through ``replica`` with the API key ``key``: its status."""
        url = replica.url + "/v1/chat/completions"
        headers = {"Authorization": f"Bearer {key}"}
        async with self.session.post(url, json=chat(), headers=headers) as r:
            await r.read()
            return r.status

    async def state(self, replica: Replica) -> tuple[Any, ...]:
        """What the admin changes set, as ``replica`` has it."""
        policy = await self.read(replica, "/admin/policy")
        aliases = await self.read(replica, "/admin/aliases")
        return (
            await self.draining(replica),
            policy["policy"],
            policy["weights"],
            aliases["aliases"],
            {name: p["drained"] for name, p in aliases["pools"].items()},
        )


@asynccontextmanager
async def running_fleet(
    tmp_path: Path,
    redis_url: str | None,
    prefix: str,
    *,
    n: int = 3,
    workers: tuple[int, ...] = (),
    auth: bool = False,
    rollout: dict[str, object] | None = None,
    capacity: dict[str, object] | None = None,
    engines: dict[str, str] | None = None,
    retry: dict[str, object] | None = None,
    health: dict[str, object] | None = None,
    **fleet: object,
) -> AsyncIterator[Fleet]:
    """``n`` replicas; ``workers``: each one's ``serve --workers`` (1 where not given);
    ``redis_url`` None: no Redis, the log in files under ``tmp_path`` (one host);
    ``engines``: the backends ``a``, ``b`` and ``c`` by URL, the test's own (serving ``m``),
    instead of fakes (``Fleet.fakes`` then empty); ``capacity``, ``retry``: those sections;
    ``health``: added to ``[health]``."""
    async with AsyncExitStack() as stack:
        fakes = {} if engines is not None else {name: FakeBackend() for name in "abc"}
        for fake in fakes.values():
            await stack.enter_async_context(running_fake(fake))
        path = tmp_path / "gateway.toml"
        path.write_text(
            config(
                engines if engines is not None else {k: f.url for k, f in fakes.items()},
                redis_url,
                prefix,
                auth=auth,
                files=tmp_path / "fleet",
                rollout=rollout,
                capacity=capacity,
                retry=retry,
                health=health,
                **fleet,
            )
        )
        counts = [*workers, *[1] * n][:n]
        replicas = [Replica(f"r{i}", path, workers=counts[i]) for i in range(n)]
        session = await stack.enter_async_context(aiohttp.ClientSession())
        try:
            await asyncio.gather(*(r.start() for r in replicas))
            f = Fleet(replicas, fakes, session)
            for r in replicas:  # every backend up and listing its model, on every replica
                await wait_for_models(f, r)
            yield f
        finally:
            await asyncio.gather(*(r.stop() for r in replicas))


async def poll(
    read: Callable[[], Awaitable[T]],
    good: Callable[[T], bool],
    *,
    within: float = 15.0,
    what: str = "condition",
) -> T:
    """Read until ``good`` holds of what was read (at most ``within`` s); the last reading."""
    deadline = time.monotonic() + within
    while True:
        got = await read()
        if good(got):
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}; last: {got}")
        await asyncio.sleep(0.05)  # sleep-ok: polling interval of a deadline-bounded wait


async def wait_for_models(fleet: Fleet, replica: Replica) -> None:
    await poll(
        lambda: fleet.read(replica, "/admin/backends"),
        lambda doc: all(b["models"] and b["health"] == "up" for b in doc["backends"]),
        what=f"{replica.name}: backends up with their models",
    )
