"""A real Redis for tests: the machine's own, or a ``redis-server`` started on a free port."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

HOW_TO_GET_REDIS = (
    "These tests need a real Redis. Start one at 127.0.0.1:6379, or install redis-server so "
    "the tests can start their own (Debian/Ubuntu: `sudo apt-get install redis-server`; "
    "macOS: `brew install redis`; or `docker run -p 6379:6379 redis:7`)."
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def ping(port: int, host: str = "127.0.0.1") -> bool:
    client = redis.Redis(host=host, port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


@dataclass
class RedisServer:
    """A ``redis-server`` child process (no persistence), stoppable and restartable."""

    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, within: float = 10.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail(HOW_TO_GET_REDIS)
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--enable-debug-command", "local"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + within
        while not ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"redis-server did not start on port {self.port}")
            time.sleep(0.01)  # sleep-ok: polling interval of a deadline-bounded wait

    def stop(self) -> None:
        """Kill it at once, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """Stop it (SIGSTOP): connections and commands wait in the kernel, unanswered."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def unread(self) -> int:
        """Bytes clients have sent that it has not read yet (the kernel's receive queues of
        its connections, from ``/proc/net/tcp``)."""
        total = 0
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if state == "01" and int(local.split(":")[1], 16) == self.port:  # established
                total += int(queues.split(":")[1], 16)
        return total
