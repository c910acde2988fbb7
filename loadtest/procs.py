"""Servers as subprocesses: simulators, the gateway, fake backends; their CPU and memory.

Each process writes its output to a log file (never a pipe nobody reads) and is stopped with
SIGTERM, then SIGKILL. CPU and RSS come from ``/proc/<pid>/`` (Linux).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

import aiohttp

_CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
_PAGE: Final = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (fields 14 and 15 of /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (/proc/<pid>/statm, second field, in pages)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def free_port() -> int:
    """A port that was free a moment ago (for servers that cannot report theirs)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` different ports that were free a moment ago (held all at once, so none repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def pin(pid: int, cpus: set[int] | None) -> None:
    """Restrict ``pid`` to ``cpus`` if given and if this machine has them."""
    if cpus and cpus <= set(range(os.cpu_count() or 1)):
        os.sched_setaffinity(pid, cpus)


@dataclass(slots=True)
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    url: str
    log_path: Path
    cmd: list[str]
    admin_token: str | None = None
    killed: bool = False
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def kill(self) -> None:
        """SIGKILL: the process dies at once, as a crashed server does."""
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(signal.SIGKILL)

    def stop(self, timeout: float = 5.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        else:
            self.popen.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def stop_all(ps: Sequence[Proc], timeout: float = 5.0) -> None:
    """Stop several processes at once: SIGTERM to all, then wait for each."""
    for p in ps:
        if p.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.popen.terminate()
    for p in ps:
        p.stop(timeout)


def spawn(
    name: str,
    cmd: Sequence[str],
    log_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    cpus: set[int] | None = None,
    url: str = "",
    admin_token: str | None = None,
) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the Proc, closed in stop()
    full_env = {**os.environ, **(env or {})}
    popen = subprocess.Popen(
        list(cmd), stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
    )
    pin(popen.pid, cpus)
    return Proc(name, popen, url, log_path, list(cmd), admin_token, _log=log)


def gateway_cli() -> list[str]:
    return [sys.executable, "-m", "gateway"]


def start_sim(
    name: str,
    args: Sequence[str],
    log_dir: Path,
    *,
    port: int = 0,
    admin_token: str | None = None,
    cpus: set[int] | None = None,
) -> Proc:
    """``llm-gateway sim --port PORT ARGS``. Port 0 picks one (``wait_sim_url`` fills in the
    URL); a port fixed up front lets a restart reuse it."""
    cmd = [*gateway_cli(), "sim", "--port", str(port), *args]
    if admin_token:
        cmd += ["--admin-token", admin_token]
    url = f"http://127.0.0.1:{port}" if port else ""
    return spawn(name, cmd, log_dir, cpus=cpus, url=url, admin_token=admin_token)


async def wait_sim_url(proc: Proc, within: float = 30.0) -> str:
    """Read the simulator's URL from its log ('serving ... on http://...')."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited: {proc.log_path.read_text()[-2000:]}")
        m = re.search(r" on (http://\S+)", proc.log_path.read_text(errors="replace"))
        if m:
            proc.url = m.group(1)
            return proc.url
        await asyncio.sleep(0.05)  # sleep-ok: polling a log file with a deadline
    raise TimeoutError(f"{proc.name} did not start within {within}s")


def start_gateway(
    backends: Sequence[str],
    policy: str,
    log_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    cpus: set[int] | None = None,
    port: int | None = None,
    name: str = "gateway",
) -> Proc:
    port = port or free_port()
    cmd = [
        *gateway_cli(),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backends",
        ",".join(backends),
        "--policy",
        policy,
    ]
    env = {"GATEWAY_LOG_FORMAT": "json", **(env or {})}
    return spawn(name, cmd, log_dir, env=env, cpus=cpus, url=f"http://127.0.0.1:{port}")


async def wait_ok(proc: Proc, path: str, within: float = 30.0) -> None:
    """Poll ``GET proc.url + path`` until it answers 200."""
    deadline = time.monotonic() + within
    timeout = aiohttp.ClientTimeout(total=1.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited: {proc.log_path.read_text()[-2000:]}")
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.get(proc.url + path) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.05)  # sleep-ok: polling readiness with a deadline
    raise TimeoutError(f"{proc.name} not ready at {path} within {within}s")


async def fetch_text(session: aiohttp.ClientSession, url: str) -> str | None:
    """GET ``url`` as text, or None when the server cannot be reached."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=3.0)) as resp:
            return await resp.text() if resp.status == 200 else None
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None


async def put_faults(
    session: aiohttp.ClientSession, proc: Proc, faults: Mapping[str, object]
) -> None:
    headers = {"Authorization": f"Bearer {proc.admin_token}"}
    async with session.put(f"{proc.url}/sim/faults", json=dict(faults), headers=headers) as resp:
        if resp.status != 200:
            text = await resp.text()
            raise RuntimeError(f"{proc.name}: /sim/faults answered {resp.status}: {text}")


_ADMIN_TIMEOUT: Final = aiohttp.ClientTimeout(total=5.0)


async def _backends(session: aiohttp.ClientSession, admin: str, token: str) -> list[dict[str, Any]]:
    """``GET /admin/backends`` of the gateway whose admin API is at ``admin``."""
    headers = {"Authorization": f"Bearer {token}"}
    url = f"{admin}/admin/backends"
    async with session.get(url, headers=headers, timeout=_ADMIN_TIMEOUT) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
        listed: list[dict[str, Any]] = (await resp.json())["backends"]
    return listed


async def admin_backend_ids(
    session: aiohttp.ClientSession, admin: str, token: str, urls: Sequence[str]
) -> list[str]:
    """The ids that the gateway whose admin API is at ``admin`` gives the backends at ``urls``
    (``GET /admin/backends``), in the same order; a backend it does not list raises."""
    by_url = {b["url"].rstrip("/"): b["id"] for b in await _backends(session, admin, token)}
    missing = [u for u in urls if u.rstrip("/") not in by_url]
    if missing:
        raise RuntimeError(f"{admin}: no backend at {missing} (it lists {sorted(by_url)})")
    return [by_url[u.rstrip("/")] for u in urls]


async def set_draining(
    session: aiohttp.ClientSession, admin: str, token: str, backend_id: str, draining: bool
) -> None:
    """Drain (or undrain) ``backend_id`` in the gateway whose admin API is at ``admin``, as an
    operator would; raises unless the gateway answers that it now is (or is not) draining."""
    headers = {"Authorization": f"Bearer {token}"}
    verb = "drain" if draining else "undrain"
    url = f"{admin}/admin/backends/{backend_id}/{verb}"
    async with session.post(url, headers=headers, timeout=_ADMIN_TIMEOUT) as resp:
        if resp.status != 200:
            raise RuntimeError(f"POST {url} answered {resp.status}: {await resp.text()}")
        view = await resp.json()
    if view.get("draining") is not draining:
        raise RuntimeError(f"POST {url}: the backend's draining is {view.get('draining')!r}")


async def wait_idle(
    session: aiohttp.ClientSession,
    admin: str,
    token: str,
    backend_id: str,
    within: float = 30.0,
) -> bool:
    """Wait until the gateway whose admin API is at ``admin`` has nothing in flight to
    ``backend_id`` (what "drained" means to an operator); False if that takes over ``within``
    seconds (a long stream may hold it: the caller goes on)."""
    deadline = time.monotonic() + within
    while True:
        try:
            listed = await _backends(session, admin, token)
        except RuntimeError:  # an admin API that does not answer 200 holds nothing up
            listed = []
        if not [b for b in listed if b["id"] == backend_id and b["in_flight"]]:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)  # sleep-ok: polling interval of a deadline-bounded wait


def start_redis(port: int, log_dir: Path, *, name: str = "redis") -> Proc:
    """A ``redis-server`` on ``port`` without persistence (a restart starts empty)."""
    exe = shutil.which("redis-server") or "redis-server"
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
           "--appendonly", "no", "--protected-mode", "no"]  # fmt: skip
    return spawn(name, cmd, log_dir, url=f"redis://127.0.0.1:{port}/0")


def start_gateway_with_config(
    config: Path,
    url: str,
    log_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    cpus: set[int] | None = None,
    name: str = "gateway",
) -> Proc:
    """``llm-gateway serve --config FILE``; ``url`` is where that file makes it listen."""
    cmd = [*gateway_cli(), "serve", "--config", str(config)]
    return spawn(name, cmd, log_dir, env=env, cpus=cpus, url=url)
