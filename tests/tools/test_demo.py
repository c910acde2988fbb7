"""``llm-gateway demo`` as the quickstart runs it: its printed commands work as printed, the
admin API answers with the token it printed (so ``top`` and the console work), and it stops on
SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_the_demo_prints_commands_that_work_and_an_admin_token() -> None:
    port, admin, first = free_ports(3)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "demo",
            "--port",
            str(port),
            "--admin-port",
            str(admin),
            "--backend-port",
            str(first),
            "--backends",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 30
        while not any(line.startswith("Ctrl-C") for line in lines):
            assert time.monotonic() < deadline, lines
            line = proc.stdout.readline()
            assert line, f"the demo exited: {lines}"
            lines.append(line.rstrip("\n"))
        text = "\n".join(lines)
        body = json.loads(re.search(r"-d '(.*)'", text).group(1))  # type: ignore[union-attr]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200
        assert r.text.rstrip().endswith("data: [DONE]")
        token = re.search(r"--token (\S+)", text).group(1)  # type: ignore[union-attr]
        assert f"--admin http://127.0.0.1:{admin}" in text
        r = httpx.get(
            f"http://127.0.0.1:{admin}/admin/backends",
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )
        assert r.status_code == 200
        assert len(r.json()["backends"]) == 1
        assert httpx.get(f"http://127.0.0.1:{admin}/admin/backends").status_code == 401
        # The console it names is served there (the page itself asks for the token).
        console = re.search(r"open (\S+) in a browser and sign in with (\S+)", text)
        assert console is not None
        assert console.group(1) == f"http://127.0.0.1:{admin}/"
        assert console.group(2) == token
        page = httpx.get(console.group(1), timeout=10)
        assert page.status_code == 200
        assert "<title>llm-gateway console</title>" in page.text
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
        if proc.stdout is not None:
            proc.stdout.close()
    assert code == 0
