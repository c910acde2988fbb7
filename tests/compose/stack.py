"""compose.yaml run for real: a project of its own, driven with the ``docker compose`` CLI.

``Stack`` runs compose commands against the real ``compose.yaml`` (with
``tests/compose/compose.test.yaml`` layered over it) under a project name of its own, reads
what compose publishes (only ever on 127.0.0.1), and removes everything it started. The local
images come from ``scripts/compose_env.sh``, which installs and starts what is missing.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Final

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT: Final = Path(__file__).resolve().parents[2]
OVERRIDE: Final = Path(__file__).with_name("compose.test.yaml")
MODEL: Final = "qwen2.5-7b-instruct"  # what compose.yaml's simulators serve by default
KEY: Final = "sk-compose-ci"  # compose.test.yaml's key, limited to 10 requests a minute
ADMIN_TOKEN: Final = "compose-ci-admin-token"  # passed through by compose, as from a shell


def local_images() -> dict[str, str]:
    """Install and start what compose needs (idempotent); the image variables it prints."""
    out = subprocess.run(
        [str(ROOT / "scripts" / "compose_env.sh")],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=1800,
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line and " " not in line)


class Stack:
    def __init__(self, images: dict[str, str]) -> None:
        self.project = f"llmgw-ci-{uuid.uuid4().hex[:8]}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        self.env |= images | {
            "PUBLISH_ADDRESS": "127.0.0.1",
            "GATEWAY_PUBLISH_PORT": "",  # empty: a free port each, so replicas can scale
            "ADMIN_PUBLISH_PORT": "",
            "PROMETHEUS_PUBLISH_PORT": "",
            "GATEWAY_ADMIN__TOKEN": ADMIN_TOKEN,
        }
        self.scale = {"sim": 3, "gateway": 1}

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        cmd = ["docker", "compose", "-p", self.project, "-f", str(ROOT / "compose.yaml")]
        cmd += ["-f", str(OVERRIDE), "--profile", "sim", *args]
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def up(self, **scale: int) -> None:
        """``up -d`` at the given scale (the others' unchanged); running containers kept."""
        self.scale |= scale
        flags = [f"--scale={name}={n}" for name, n in self.scale.items()]
        self.compose("up", "-d", "--pull", "never", "--no-recreate", *flags)

    def url(self, service: str, port: int, index: int = 1) -> str:
        published = self.compose("port", "--index", str(index), service, str(port)).strip()
        host, _, number = published.rpartition(":")
        assert host == "127.0.0.1", f"{service} is published on {published}, not loopback only"
        return f"http://127.0.0.1:{number}"

    def containers(self, service: str) -> list[str]:
        out = self.compose("ps", "-q", service)
        return out.split()

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "5", timeout=120)

    def leftovers(self) -> list[str]:
        """Whatever of this project docker still has: containers, networks, volumes."""
        label = f"label=com.docker.compose.project={self.project}"
        found = []
        for kind in (["ps", "-a"], ["network", "ls"], ["volume", "ls"]):
            out = subprocess.run(
                ["docker", *kind, "-q", "--filter", label],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            found += [f"{kind[0]} {x}" for x in out.split()]
        return found


def docker(*args: str) -> str:
    """One plain ``docker`` command (kill, rm, inspect a container); its output."""
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, check=True, timeout=120
    ).stdout


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def per_backend(url: str, name: str) -> dict[str, float]:
    """A per-backend metric of the gateway at ``url``, summed over its other labels."""
    out: dict[str, float] = {}
    for (sample, labels), v in metrics(url).items():
        if sample == name:
            backend = dict(labels)["backend"]
            out[backend] = out.get(backend, 0.0) + v
    return out


def eventually(check: Callable[[], bool], *, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass  # not answering yet
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:g} s waiting for {what}")
        time.sleep(0.5)  # sleep-ok: polling containers and DNS, which change in seconds
