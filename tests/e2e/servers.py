"""Real vLLM servers (the CPU build) as subprocesses, for the end-to-end tests.

vLLM lives in its own virtualenv (``.venv-vllm``, made by ``scripts/install_vllm.sh``) so its
pinned dependencies never meet the gateway's. The model is the tiny random-weight Llama that
``scripts/build_tiny_model.py`` writes; it is (re)built here when missing, which takes seconds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Final

import httpx

from tests.helpers import RunningGateway, running_gateway, wait_for

ROOT: Final = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT: Final = "scripts/install_vllm.sh"
MODEL_SCRIPT: Final = ROOT / "scripts" / "build_tiny_model.py"
LORA_SCRIPT: Final = ROOT / "scripts" / "build_tiny_lora.py"
MODEL_DIR: Final = ROOT / ".cache" / "tiny-llama"
SERVED_MODEL: Final = "tiny"
MAX_MODEL_LEN: Final = 16384
# Small on purpose: a third long request to one server waits in its queue, so the tests can
# see a non-zero queue depth without flooding a 2-core machine.
MAX_NUM_SEQS: Final = 2
# Loading and warming up takes ~35 s for one server alone on 2 cores; two at once and a busy
# machine take longer. This bounds a hung start, it is not a timing assertion.
START_DEADLINE: Final = 300.0


class VllmUnavailable(RuntimeError):
    """The vLLM virtualenv is missing or broken: the message says how to fix it."""


@cache
def vllm_python() -> Path:
    """The vLLM virtualenv's interpreter (``$VLLM_VENV`` or ``.venv-vllm``), checked to work.

    Checked once per session (importing vllm takes seconds); a failure is not cached.
    """
    venv = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
    python = venv / "bin" / "python"
    fix = f"run `{INSTALL_SCRIPT}` (or `make vllm`) from the repository root first"
    if not python.is_file():
        raise VllmUnavailable(f"no vLLM virtualenv at {venv}: {fix}")
    probe = subprocess.run(
        [str(python), "-c", "import vllm, transformers, tokenizers"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if probe.returncode != 0:
        raise VllmUnavailable(
            f"the vLLM virtualenv at {venv} cannot import vllm ({probe.stderr.strip()[-500:]}): "
            f"{fix}"
        )
    return python


def build_model(python: Path) -> Path:
    """Build the tiny model unless it is up to date; return its directory."""
    done = subprocess.run(
        [str(python), str(MODEL_SCRIPT), "--out", str(MODEL_DIR)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        timeout=300,
    )
    if done.returncode != 0:
        raise VllmUnavailable(f"building the tiny model failed:\n{done.stderr[-2000:]}")
    return MODEL_DIR


def build_lora(python: Path, out: Path, seed: int = 0) -> Path:
    """A random LoRA adapter for the tiny model (``scripts/build_tiny_lora.py``), in ``out``."""
    done = subprocess.run(
        [
            str(python),
            str(LORA_SCRIPT),
            "--model",
            str(MODEL_DIR),
            "--out",
            str(out),
            "--seed",
            str(seed),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if done.returncode != 0:
        raise VllmUnavailable(f"building the LoRA adapter failed:\n{done.stderr[-2000:]}")
    return out


def free_port() -> int:
    """A port that was free a moment ago (vLLM binds its own socket, so it cannot be handed one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` process and its log."""

    name: str
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes]
    cpu: str = "0"
    extra: tuple[str, ...] = ()  # its engine arguments beyond the common ones, kept on restart
    started_at: float = field(default_factory=time.monotonic)
    ready_after: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the server's process group (API server, engine core, worker), then SIGKILL."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # Children the API server did not reap (they share its process group).
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def launch(
    python: Path,
    model: Path,
    name: str,
    log_dir: Path,
    *,
    cpu: str,
    extra: Sequence[str] = (),
    log_name: str | None = None,
) -> VllmServer:
    port = free_port()
    log_path = log_dir / f"{log_name or name}.log"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; otherwise it reserves most of the machine's RAM
        "VLLM_CPU_OMP_THREADS_BIND": cpu,  # one core each, so two servers do not fight
        "VLLM_NO_USAGE_STATS": "1",
        # The Responses API's store (off by default in vLLM): tests/e2e/test_endpoints.py
        # fetches stored responses back through the gateway.
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
        # LoRA adapters loaded at run time (with --enable-lora): tests/e2e/test_endpoints.py
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        # The dev-mode routes (/sleep, /wake_up, /is_sleeping): tests/e2e/test_sleep.py, the
        # gateway's capacity manager putting a server to sleep and waking it
        "VLLM_SERVER_DEV_MODE": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--enable-log-requests",
        "--disable-uvicorn-access-log",
        *extra,
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=ROOT,
            # Its own process group, so stop() reaches every child; not its own session: with
            # the kernel's autogroup scheduling (on by default), a session is a scheduling
            # group, and a CPU vLLM server in one (its worker's threads pinned and spinning)
            # starved this session's processes, the gateway and the test, for as long as it
            # generated: 13-30 s stalls, a client's disconnect seen at the end of the answer.
            process_group=0,
        )
    return VllmServer(
        name=name, port=port, log_path=log_path, proc=proc, cpu=cpu, extra=tuple(extra)
    )


def wait_healthy(
    servers: list[VllmServer], deadline: float, relaunch: Callable[[VllmServer], VllmServer]
) -> None:
    """Poll each server's /health until 200; fail at once if one exits, or at ``deadline``.

    A server that lost the race for its port (another process took it between ``free_port``
    and vLLM's bind) is started again on a new one; ``servers`` is updated in place.
    """
    pending = list(servers)
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for server in list(pending):
                if server.proc.poll() is not None:
                    if "Address already in use" in server.log():
                        again = relaunch(server)
                        servers[servers.index(server)] = again
                        pending[pending.index(server)] = again
                        continue
                    raise RuntimeError(
                        f"vLLM server {server.name} exited with {server.proc.returncode} while "
                        f"starting; log {server.log_path}:\n{server.log_tail()}"
                    )
                try:
                    ok = client.get(f"{server.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    server.ready_after = time.monotonic() - server.started_at
                    pending.remove(server)
            if pending and time.monotonic() > deadline:
                tails = "\n\n".join(f"{s.name} ({s.log_path}):\n{s.log_tail()}" for s in pending)
                raise RuntimeError(f"vLLM servers not healthy in time:\n{tails}")
            time.sleep(0.25)  # sleep-ok: polling interval of a deadline-bounded wait


@contextmanager
def running_vllm_servers(
    n: int, log_dir: Path, extra: Callable[[str], Sequence[str]] | None = None
) -> Iterator[list[VllmServer]]:
    """Start ``n`` vLLM servers on the tiny model at once; stop them all on exit.

    ``extra(name)``: more engine arguments for the server of that name (asked again when it
    is started again, so ports it names can be fresh).
    """
    python = vllm_python()
    model = build_model(python)
    cores = sorted(os.sched_getaffinity(0))
    cpus = {f"vllm{i}": str(cores[i % len(cores)]) for i in range(n)}

    def args(name: str) -> Sequence[str]:
        return extra(name) if extra is not None else ()

    def relaunch(old: VllmServer) -> VllmServer:
        old.stop()
        return launch(python, model, old.name, log_dir, cpu=cpus[old.name], extra=args(old.name))

    servers: list[VllmServer] = []
    try:
        for name, cpu in cpus.items():
            servers.append(launch(python, model, name, log_dir, cpu=cpu, extra=args(name)))
        wait_healthy(servers, time.monotonic() + START_DEADLINE, relaunch)
        yield servers
    finally:
        for server in servers:
            server.stop()


def kill(server: VllmServer) -> None:
    """SIGKILL the server's whole process group at once, as a dying machine would."""
    with suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=10)


def restart(servers: list[VllmServer], server: VllmServer) -> VllmServer:
    """Start ``server`` (stopped or killed) again, on a new port, in its place in ``servers``;
    return once it is healthy. Its new log is beside the old one."""
    server.stop()
    python, n = vllm_python(), sum(1 for p in server.log_path.parent.glob(f"{server.name}*.log"))

    def again(old: VllmServer) -> VllmServer:
        old.stop()
        return launch(
            python,
            MODEL_DIR,
            old.name,
            old.log_path.parent,
            cpu=old.cpu,
            extra=old.extra,
            log_name=f"{old.name}-{n}",
        )

    fresh = [again(server)]
    wait_healthy(fresh, time.monotonic() + START_DEADLINE, again)
    servers[servers.index(server)] = fresh[0]
    return fresh[0]


# Real servers on a shared 2-core machine can take a second to answer a probe or a scrape: the
# test helpers' defaults (made for in-process fakes) would mark them down or their figures stale.
E2E_SCRAPE: Final = {"interval": 0.1, "timeout": 5.0, "stale_after": 10.0, "models_interval": 1.0}
E2E_HEALTH: Final = {"interval": 0.5, "timeout": 5.0}


@asynccontextmanager
async def gateway_for(
    servers: Sequence[VllmServer], **overrides: Any
) -> AsyncIterator[RunningGateway]:
    """The gateway in-process in front of ``servers``, once every one of them is routable."""
    async with running_gateway(
        [s.url for s in servers], scrape=E2E_SCRAPE, health=E2E_HEALTH, **overrides
    ) as gw:
        pool = gw.svc.pool
        await wait_for(
            lambda: all(pool.routable(b, pool.now()) for b in pool.all()),
            within=30.0,
            what="every vLLM server routable",
        )
        yield gw
