"""A running gateway as operators run it, for the console's browser tests and its screenshot.

The shipped production configuration (``deploy/gateway.production.toml``: keys in tiers,
Redis-shared limits, the admission queue, prefix affinity, a stable pool and a canary behind
the ``chat`` alias) with only its addresses changed through the environment, in front of three
``llm-gateway sim`` processes; and ``Traffic``, clients streaming through it with the file's
example keys while a test looks at the page. ``another_replica`` starts one more gateway of
the same fleet (the same file, Redis and simulators) beside it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.procs import (
    Proc,
    free_port,
    start_gateway_with_config,
    start_sim,
    stop_all,
    wait_ok,
    wait_sim_url,
)

CONFIG = Path(__file__).resolve().parents[4] / "deploy" / "gateway.production.toml"
MODEL = "llama"  # what the file's pools serve
BACKENDS = ("gpu-a", "gpu-b", "gpu-canary")
KEYS = {
    "web-app": "sk-prod-interactive-example",
    "nightly-batch": "sk-prod-batch-example",
    "internal-tools": "sk-prod-internal-example",  # the default tier: 60 a minute, 4 at once
}


@dataclass
class Fleet:
    url: str
    admin_url: str
    token: str
    gateway: Proc
    sims: list[Proc]
    env: dict[str, str]

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def admin(
        self, method: str, path: str, headers: dict[str, str] | None = None, **kwargs: object
    ) -> httpx.Response:
        """An admin call with the token (and ``headers``: more, e.g. an Idempotency-Key)."""
        return httpx.request(
            method,
            self.admin_url + path,
            headers={**self.admin_headers, **(headers or {})},
            timeout=5,
            **kwargs,  # type: ignore[arg-type]
        )

    def requests_to(self, backend: str) -> float:
        """Requests the gateway has counted for ``backend`` (its public /metrics)."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "llm_gateway_requests_total" and s.labels.get("backend") == backend
        )

    def backend(self, backend: str) -> dict[str, object]:
        doc = self.admin("GET", "/admin/backends").json()
        found: dict[str, object] = next(b for b in doc["backends"] if b["id"] == backend)
        return found


def chat(client: httpx.Client, url: str, key: str, model: str = MODEL) -> int:
    """One streamed chat request, read to its end; its status."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"tell me about {uuid.uuid4().hex[:8]}"}],
        "stream": True,
        "max_tokens": 16,
    }
    headers = {"Authorization": f"Bearer {key}"}
    with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        for _ in r.iter_bytes():
            pass
        return r.status_code


T = TypeVar("T")


def _wait(coro: Coroutine[Any, Any, T]) -> T:
    """Run one of ``loadtest.procs``' waits from sync code, even beside Playwright's loop."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@contextmanager
def running_fleet(
    log_dir: Path, redis_url: str, redis_prefix: str, extra: dict[str, str] | None = None
) -> Iterator[Fleet]:
    """The gateway and its simulators; ``extra``: more of its settings (``GATEWAY_...``)."""
    port, admin_port = free_port(), free_port()
    token = f"console-{uuid.uuid4().hex}"
    with ExitStack() as stack:
        sims = [
            start_sim(name, ["--served-model-name", MODEL, "--seed", str(i)], log_dir)
            for i, name in enumerate(BACKENDS)
        ]
        stack.callback(stop_all, sims)
        urls = [_wait(wait_sim_url(s)) for s in sims]
        env = {
            "GATEWAY_HOST": "127.0.0.1",
            "GATEWAY_PORT": str(port),
            "GATEWAY_ADMIN__HOST": "127.0.0.1",
            "GATEWAY_ADMIN__PORT": str(admin_port),
            "GATEWAY_ADMIN__TOKEN": token,
            "GATEWAY_BACKENDS": json.dumps(
                [{"url": u, "name": n} for u, n in zip(urls, BACKENDS, strict=True)]
            ),
            "GATEWAY_LIMITS__REDIS__URL": redis_url,
            "GATEWAY_LIMITS__REDIS__KEY_PREFIX": redis_prefix,
            # The production file's 50 ms is a budget for Redis on a real network; on two
            # cores shared with the simulators, Prometheus and the traffic, one slow answer
            # would admit a request unchecked and fire LimitsDegraded in a healthy run.
            "GATEWAY_LIMITS__REDIS__TIMEOUT": "0.5",
            "GATEWAY_TRACING__OTLP_ENDPOINT": "",  # traffic stays on this machine
            **(extra or {}),
        }
        gateway = start_gateway_with_config(CONFIG, f"http://127.0.0.1:{port}", log_dir, env=env)
        stack.callback(gateway.stop)
        _wait(wait_ok(gateway, "/ready"))
        yield Fleet(gateway.url, f"http://127.0.0.1:{admin_port}", token, gateway, sims, env)


@contextmanager
def another_replica(fleet: Fleet, name: str) -> Iterator[Fleet]:
    """One more replica of ``fleet``'s gateway, on ports of its own, its fleet id ``name``."""
    port, admin_port = free_port(), free_port()
    env = {
        **fleet.env,
        "GATEWAY_PORT": str(port),
        "GATEWAY_ADMIN__PORT": str(admin_port),
        "GATEWAY_FLEET__REPLICA": name,
    }
    url = f"http://127.0.0.1:{port}"
    log_dir = fleet.gateway.log_path.parent
    replica = start_gateway_with_config(CONFIG, url, log_dir, env=env, name=name)
    try:
        _wait(wait_ok(replica, "/ready"))
        yield Fleet(url, f"http://127.0.0.1:{admin_port}", fleet.token, replica, fleet.sims, env)
    finally:
        replica.stop()


@dataclass
class Traffic:
    """Clients streaming through the gateway in a thread until stopped: the interactive key on
    the ``chat`` alias and the model, and the default-tier key past its concurrency limit."""

    url: str
    statuses: dict[int, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _run(self, key: str, model: str) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                try:
                    status = chat(client, self.url, key, model)
                except httpx.HTTPError:
                    status = 0
                self.statuses[status] = self.statuses.get(status, 0) + 1
                if status != 200:
                    time.sleep(0.1)  # sleep-ok: a refused client backs off before trying again

    def start(self, streams: int = 4, over_limit: int = 6) -> Traffic:
        plan = [(KEYS["web-app"], "chat" if i % 2 else MODEL) for i in range(streams)]
        plan += [(KEYS["internal-tools"], MODEL)] * over_limit
        for key, model in plan:
            t = threading.Thread(target=self._run, args=(key, model), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)
