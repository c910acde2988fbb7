"""The peer bench's processes: start them pinned to a CPU in their own process group, stop the
group, and read a process tree's CPU time and RSS from ``/proc``. Linux only, stdlib only."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from typing import Final

CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
PAGE_KB: Final = os.sysconf("SC_PAGE_SIZE") // 1024


def log(*a: object) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


class Procs:
    """The processes one run started, so that an interrupted run stops every one of them."""

    def __init__(self, cwd: str) -> None:
        self.cwd = cwd
        self._started: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        cmd_list: list[str],
        cpu: int | None,
        log_path: str,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        full = (["taskset", "-c", str(cpu)] if cpu is not None else []) + cmd_list
        e = dict(os.environ)
        if env:
            e.update(env)
        with open(log_path, "ab") as f:
            f.write(("\n$ " + " ".join(shlex.quote(x) for x in full) + "\n").encode())
            f.flush()
            p = subprocess.Popen(
                full,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=e,
                start_new_session=True,
                cwd=self.cwd,
            )
        self._started.append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes] | None, timeout: float = 10) -> None:
        """Stop a process we started (and its process group, which has its PID as id)."""
        if p is None:
            return
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        else:
            # leader gone; make sure no group members linger
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        if p in self._started:
            self._started.remove(p)

    def stop_all(self) -> None:
        for p in list(self._started):
            self.stop(p, timeout=5)


def tree_pids(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
            ppid = int(s[s.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(d))
        except (OSError, ValueError):
            pass
    out, stack = [], [root]
    while stack:
        x = stack.pop()
        out.append(x)
        stack.extend(children.get(x, []))
    return out


def tree_usage(root: int) -> tuple[float, float]:
    """(rss_mb, cpu_seconds) summed over root and its descendants."""
    rss_pages = 0
    ticks = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/stat") as f:
                s = f.read()
            fields = s[s.rindex(")") + 2 :].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
            with open(f"/proc/{pid}/statm") as f:
                rss_pages += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            pass
    return rss_pages * PAGE_KB / 1024.0, ticks / CLK_TCK


class Sampler(threading.Thread):
    """Peak RSS of a process tree, sampled every ``period`` seconds until ``finish``."""

    def __init__(self, pid: int, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.peak = 0.0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            rss, _ = tree_usage(self.pid)
            self.peak = max(self.peak, rss)
            self._halt.wait(self.period)

    def finish(self) -> float:
        self._halt.set()
        self.join(2)
        return self.peak


def http_ok(url: str, body: object = None, timeout: float = 5, api_key: str = "") -> bool:
    try:
        data = json.dumps(body).encode() if body is not None else None
        h = {"Content-Type": "application/json"}
        if api_key:
            h["Authorization"] = "Bearer " + api_key
        req = urllib.request.Request(url, data=data, headers=h)
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return bool(r.status == 200)
    except Exception:
        return False


def wait_ready(
    base: str,
    model: str,
    proc: subprocess.Popen[bytes] | None,
    timeout: float,
    api_key: str = "",
) -> tuple[bool, float | str]:
    """Poll until a small chat request through ``base`` succeeds: (True, seconds it took), or
    (False, why not) when the process exits or ``timeout`` passes."""
    t0 = time.time()
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            return False, f"process exited with code {proc.returncode} during startup"
        if http_ok(base + "/v1/chat/completions", body, api_key=api_key):
            return True, round(time.time() - t0, 2)
        time.sleep(0.5)
    return False, f"not ready after {timeout}s"


def tail(path: str, n: int = 25) -> str:
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])
    except OSError:
        return ""


def port_free(port: int) -> bool:
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def sh(
    cmd: str, timeout: float = 900, log_path: str | None = None
) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        cmd, shell=True, capture_output=True, text=True, timeout=timeout, check=False
    )
    if log_path:
        with open(log_path, "a") as f:
            f.write(f"$ {cmd}\n{r.stdout}\n{r.stderr}\nrc={r.returncode}\n")
    return r
