"""The soak's processes: Redis, an OTLP sink, three simulators, two gateway replicas.

Every port is chosen up front, so a process killed with SIGKILL comes back on the same one.
The gateways run the production file rewritten per replica (``loadtest.soak.config``), the
admin token in ``GATEWAY_ADMIN__TOKEN``. Everything here is I/O; what it reads is judged by
``loadtest.soak.invariants``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import time
import tomllib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web
from multidict import CIMultiDict
from redis.exceptions import RedisError

from loadtest import procs
from loadtest.soak import prom as soak_prom
from loadtest.soak.config import BACKENDS, SERVED_MODEL, dumps, rewrite
from loadtest.soak.invariants import ReplicaGauges

REPLICAS: Final = 2
# Long enough streams to leave mid-way (~30 ms a token), cheap enough for two cores.
SIM_ARGS: Final = ("--model", SERVED_MODEL, "--sim-step-base-ms", "30", "--max-num-seqs", "64")
_TIMEOUT: Final = aiohttp.ClientTimeout(total=3.0)


@dataclass(frozen=True, slots=True)
class Answer:
    """An admin API call's answer: status (0: none), parsed JSON (or text), headers."""

    status: int
    doc: Any
    headers: Mapping[str, str] = field(default_factory=dict)


class OtlpSink:
    """An OTLP/HTTP traces endpoint that answers 200 and counts what it gets."""

    def __init__(self) -> None:
        self.posts = 0
        self.bytes = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _traces(self, request: web.Request) -> web.Response:
        self.bytes += len(await request.read())
        self.posts += 1
        return web.Response(status=200, content_type="application/x-protobuf", body=b"")

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/v1/traces"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@dataclass(slots=True)
class Fleet:
    run_dir: Path
    production: dict[str, Any]
    token: str = field(default_factory=lambda: secrets.token_hex(12))
    key_prefix: str = field(default_factory=lambda: f"soak:{secrets.token_hex(6)}:")
    sim_ports: dict[str, int] = field(default_factory=dict)
    sims: dict[str, procs.Proc] = field(default_factory=dict)
    redis_port: int = 0
    redis: procs.Proc | None = None  # the run's own redis-server, the only one it ever signals
    redis_paused: bool = False
    gateways: list[procs.Proc] = field(default_factory=list)
    ports: list[tuple[int, int]] = field(default_factory=list)  # (port, admin port) per replica
    sink: OtlpSink = field(default_factory=OtlpSink)
    carried_aborts: Counter[str] = field(default_factory=Counter)  # killed sims' counts by phase
    _generation: Counter[str] = field(default_factory=Counter)
    _dead: list[procs.Proc] = field(default_factory=list)

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def config_path(self, replica: int) -> Path:
        return self.run_dir / f"gateway-{replica}.toml"

    def admin_url(self, replica: int) -> str:
        return f"http://127.0.0.1:{self.ports[replica][1]}"

    @property
    def urls(self) -> list[str]:
        return [g.url for g in self.gateways]

    # -- start and stop ----------------------------------------------------------------------

    async def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        await self.sink.start()
        self.redis_port = procs.free_port()
        self.redis = procs.start_redis(self.redis_port, self.log_dir)
        for name in BACKENDS:
            self.sim_ports[name] = procs.free_port()
            self.sims[name] = self._spawn_sim(name)
        self.ports = [(procs.free_port(), procs.free_port()) for _ in range(REPLICAS)]
        await self.wait_redis()
        await asyncio.gather(*(procs.wait_ok(s, "/health") for s in self.sims.values()))
        self.write_configs()
        env = {"GATEWAY_ADMIN__TOKEN": self.token, "GATEWAY_LOG_FORMAT": "json"}
        for r, (port, _) in enumerate(self.ports):
            self.gateways.append(
                procs.start_gateway_with_config(
                    self.config_path(r),
                    f"http://127.0.0.1:{port}",
                    self.log_dir,
                    env=env,
                    name=f"gateway-{r}",
                )
            )
        await asyncio.gather(*(procs.wait_ok(g, "/ready", within=60.0) for g in self.gateways))
        async with aiohttp.ClientSession(timeout=_TIMEOUT) as session:
            for r in range(REPLICAS):  # every backend up and serving the model, on both
                await self.wait_backends(session, r, set(BACKENDS), within=30.0)

    def _spawn_sim(self, name: str) -> procs.Proc:
        self._generation[name] += 1
        n = self._generation[name]
        args = (*SIM_ARGS, "--seed", str(BACKENDS.index(name) * 100 + n))
        log_name = name if n == 1 else f"{name}.{n}"
        return procs.start_sim(
            log_name, args, self.log_dir, port=self.sim_ports[name], admin_token=self.token
        )

    async def stop(self) -> None:
        self.resume_redis()  # a stopped process would not hear SIGTERM
        everything = [*self.gateways, *self.sims.values(), *self._dead]
        if self.redis is not None:
            everything.append(self.redis)
        await asyncio.to_thread(procs.stop_all, everything)
        await self.sink.stop()

    def write_configs(self, aliases: Mapping[str, Mapping[str, float]] | None = None) -> None:
        sims = {n: f"http://127.0.0.1:{p}" for n, p in self.sim_ports.items()}
        for r, (port, admin_port) in enumerate(self.ports):
            doc = rewrite(
                self.production,
                sims=sims,
                redis_url=self.redis_url,
                key_prefix=self.key_prefix,
                otlp_endpoint=self.sink.url,
                port=port,
                admin_port=admin_port,
                aliases=aliases,
            )
            text = dumps(doc)
            tomllib.loads(text)  # never hand a replica a file it cannot read
            self.config_path(r).write_text(text)

    # -- faults --------------------------------------------------------------------------------

    async def kill_sim(self, session: aiohttp.ClientSession, name: str) -> None:
        """Keep the simulator's abort counts (a restart resets them), then SIGKILL it."""
        aborted = await self.sim_aborts(session, name)
        proc = self.sims[name]
        proc.kill()
        await asyncio.to_thread(proc.popen.wait)
        self.carried_aborts.update(aborted or {})
        self._dead.append(proc)

    async def restart_sim(self, name: str) -> None:
        self.sims[name] = self._spawn_sim(name)
        await procs.wait_ok(self.sims[name], "/health")

    async def kill_redis(self) -> None:
        if self.redis is not None:
            self.redis.kill()
            await asyncio.to_thread(self.redis.popen.wait)
            self._dead.append(self.redis)
            self.redis = None
            self.redis_paused = False

    def pause_redis(self) -> None:
        """SIGSTOP the run's own redis-server: connections are still accepted by the kernel and
        commands wait in its sockets, unanswered, until ``resume_redis``."""
        if self.redis is not None and self.redis.popen.poll() is None:
            self.redis.popen.send_signal(signal.SIGSTOP)
            self.redis_paused = True

    def resume_redis(self) -> None:
        if self.redis is not None and self.redis_paused and self.redis.popen.poll() is None:
            self.redis.popen.send_signal(signal.SIGCONT)
        self.redis_paused = False

    async def restart_redis(self) -> None:
        n = len([p for p in self._dead if p.name.startswith("redis")])
        self.redis = procs.start_redis(self.redis_port, self.log_dir, name=f"redis.{n + 1}")
        await self.wait_redis()

    async def wait_redis(self, within: float = 10.0) -> None:
        deadline = time.monotonic() + within
        while await self.redis_slots() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server did not answer on port {self.redis_port}")
            await asyncio.sleep(0.05)  # sleep-ok: polling a starting server with a deadline

    async def put_sim_faults(
        self, session: aiohttp.ClientSession, name: str, faults: Mapping[str, object]
    ) -> None:
        await procs.put_faults(session, self.sims[name], faults)

    # -- reading -------------------------------------------------------------------------------

    async def admin(
        self,
        session: aiohttp.ClientSession,
        replica: int,
        method: str,
        path: str,
        body: object = None,
    ) -> tuple[int, Any]:
        """One admin API call on ``replica``: (status, parsed JSON or text)."""
        status, doc, _ = await self.admin_change(session, replica, method, path, body)
        return status, doc

    async def admin_change(
        self,
        session: aiohttp.ClientSession,
        replica: int,
        method: str,
        path: str,
        body: object = None,
    ) -> tuple[int, Any, str | None]:
        """``admin``, with the answer's ``X-Gateway-Replicas`` (how many replicas applied it)."""
        answer = await self.call_admin(session, replica, method, path, body)
        return answer.status, answer.doc, answer.headers.get("X-Gateway-Replicas")

    async def call_admin(
        self,
        session: aiohttp.ClientSession,
        replica: int,
        method: str,
        path: str,
        body: object = None,
        *,
        key: str | None = None,
        within: float | None = None,
    ) -> Answer:
        """One admin API call on ``replica``; ``key``: its ``Idempotency-Key``; ``within``:
        seconds to wait for the answer (None: the session's timeout)."""
        headers = {"Authorization": f"Bearer {self.token}"}
        if key is not None:
            headers["Idempotency-Key"] = key
        url = self.admin_url(replica) + path
        wait = session.timeout if within is None else aiohttp.ClientTimeout(total=within)
        try:
            async with session.request(
                method, url, json=body, headers=headers, timeout=wait
            ) as resp:
                text = await resp.text()
                got = CIMultiDict(resp.headers)
                try:
                    return Answer(resp.status, json.loads(text), got)
                except ValueError:
                    return Answer(resp.status, text, got)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return Answer(0, f"{type(exc).__name__}: {exc}")

    async def backend_health(self, session: aiohttp.ClientSession, replica: int) -> dict[str, str]:
        status, doc = await self.admin(session, replica, "GET", "/admin/backends")
        if status != 200 or not isinstance(doc, dict):
            return {}
        return {
            b["id"]: b["health"] if SERVED_MODEL in b.get("models", []) else "no-model"
            for b in doc.get("backends", [])
        }

    async def wait_backends(
        self, session: aiohttp.ClientSession, replica: int, names: set[str], within: float
    ) -> bool:
        """Wait until ``replica`` sees every backend in ``names`` up; False at the deadline."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            health = await self.backend_health(session, replica)
            if all(health.get(n) == "up" for n in names):
                return True
            await asyncio.sleep(0.1)  # sleep-ok: polling the admin API with a deadline
        return False

    async def gateway_metrics(self, session: aiohttp.ClientSession, replica: int) -> str | None:
        return await procs.fetch_text(session, f"{self.gateways[replica].url}/metrics")

    async def gateway_gauges(
        self, session: aiohttp.ClientSession, replica: int
    ) -> ReplicaGauges | None:
        text = await self.gateway_metrics(session, replica)
        if text is None:
            return None
        found = soak_prom.samples(text)
        return ReplicaGauges(
            in_flight=soak_prom.by_label(found, "llm_gateway_backend_in_flight", "backend"),
            queue_length=soak_prom.total(found, "llm_gateway_admission_queue_length"),
            holding=soak_prom.total(found, "llm_gateway_admission_holding"),
        )

    async def sim_state(self, session: aiohttp.ClientSession, name: str) -> dict[str, Any] | None:
        return await self._sim_admin(session, name, "/sim/state")

    async def sim_faults(self, session: aiohttp.ClientSession, name: str) -> dict[str, Any] | None:
        return await self._sim_admin(session, name, "/sim/faults")

    async def _sim_admin(
        self, session: aiohttp.ClientSession, name: str, path: str
    ) -> dict[str, Any] | None:
        """A simulator's admin document, or None if it cannot be read now."""
        headers = {"Authorization": f"Bearer {self.token}"}
        try:
            async with session.get(f"{self.sims[name].url}{path}", headers=headers) as resp:
                if resp.status != 200:
                    return None
                doc: dict[str, Any] = await resp.json()
                return doc
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None

    async def sim_aborts(
        self, session: aiohttp.ClientSession, name: str
    ) -> dict[str, float] | None:
        """``sim:aborted_requests`` of the running instance, by phase."""
        text = await procs.fetch_text(session, f"{self.sims[name].url}/metrics")
        if text is None:
            return None
        found = soak_prom.samples(text)
        return soak_prom.by_label(found, "sim:aborted_requests_total", "phase")

    async def redis_slot_times(self) -> list[float]:
        """When each held slot was taken (Unix time): its score (expiry) less the slot TTL."""
        ttl = float(self.production.get("limits", {}).get("redis", {}).get("slot_ttl", 900.0))
        client = aioredis.Redis.from_url(
            self.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0
        )
        try:
            out: list[float] = []
            async for key in client.scan_iter(match=f"{self.key_prefix}*:c", count=1000):
                pairs: Any = await client.zrange(key, 0, -1, withscores=True)
                out += [float(score) - ttl for _, score in pairs]
            return sorted(out)
        except (RedisError, OSError):
            return []
        finally:
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()

    def store_timeouts(self) -> list[float]:
        """When the gateways logged a Redis call that timed out (Unix time), from their logs."""
        out: list[float] = []
        for g in self.gateways:
            text = g.log_path.read_text(errors="replace") if g.log_path.exists() else ""
            out += logged_store_timeouts(text)
        return sorted(out)

    async def redis_slots(self) -> int | None:
        """Concurrency slots held in the run's sorted sets (ZCARD summed); None if unreachable."""
        client = aioredis.Redis.from_url(
            self.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0
        )
        try:
            held = 0
            async for key in client.scan_iter(match=f"{self.key_prefix}*:c", count=1000):
                held += int(await client.zcard(key))
            return held
        except (RedisError, OSError):
            return None
        finally:
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()


def logged_store_timeouts(text: str) -> list[float]:
    """Unix times of ``limits_store_unavailable`` events with a TimeoutError in a JSON log."""
    out: list[float] = []
    for line in text.splitlines():
        if "limits_store_unavailable" not in line:
            continue
        try:
            event = json.loads(line)
            if event.get("event") == "limits_store_unavailable" and str(
                event.get("error", "")
            ).startswith("TimeoutError"):
                out.append(datetime.fromisoformat(event["timestamp"]).timestamp())
        except (ValueError, KeyError, TypeError):
            continue
    return out
