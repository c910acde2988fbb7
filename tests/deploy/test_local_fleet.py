"""deploy/gateway.local-fleet.toml and docs/fleet.md's "A fleet on one host": the production file
with its addresses on one host, and the documented commands that start three replicas of it
(each on ports of its own, one fleet on the local Redis), run as documented."""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.cli import main
from gateway.config.settings import Settings, load_settings
from loadtest.procs import (
    free_port,
    gateway_cli,
    spawn,
    start_sim,
    stop_all,
    wait_ok,
    wait_sim_url,
)
from tests.deploy.manifests import ROOT
from tests.gateway.fleet.replicas import poll

LOCAL = ROOT / "deploy" / "gateway.local-fleet.toml"
PRODUCTION = ROOT / "deploy" / "gateway.production.toml"
FLEET_DOC = ROOT / "docs" / "fleet.md"
TOKEN = "local-fleet-token"


def one_host_section() -> str:
    text = FLEET_DOC.read_text()
    start = text.index("## A fleet on one host")
    return text[start : text.index("\n## ", start + 1)]


def documented(command: str) -> list[list[str]]:
    """The section's ``llm-gateway <command>`` lines, as argument lists (``&`` dropped)."""
    lines = [line.split("#")[0].strip() for line in one_host_section().splitlines()]
    return [
        shlex.split(line.removesuffix("&"))
        for line in lines
        if line.startswith(f"llm-gateway {command} ")
    ]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("GATEWAY_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("GATEWAY_ADMIN__TOKEN", TOKEN)


# What the local file changes of the production one, and nothing else (its header lists them).
EDITED = {
    "host": "127.0.0.1",
    "admin.host": "127.0.0.1",
    "backends": [f"http://127.0.0.1:{port}" for port in (8001, 8002, 8003)],
    "limits.redis.url": "redis://127.0.0.1:6379/0",
    "limits.redis.timeout": 0.5,
    "tracing.otlp_endpoint": "",
}


def flat(s: Settings) -> dict[str, Any]:
    doc = s.model_dump(mode="json")
    out: dict[str, Any] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict) and path != "aliases":
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else k)
        else:
            out[path] = node

    walk(doc, "")
    out["backends"] = [b["url"] for b in doc["backends"]]
    out["limits.redis.url"] = s.limits.redis.url.get_secret_value()  # a secret: dumped masked
    return out


@pytest.mark.usefixtures("clean_env")
def test_the_local_file_is_the_production_file_with_its_addresses_on_this_host() -> None:
    local, production = flat(load_settings(LOCAL)), flat(load_settings(PRODUCTION))
    changed = {k for k in local if local[k] != production.get(k)}
    assert changed == set(EDITED)
    assert {k: local[k] for k in EDITED} == EDITED
    # The backends keep the names the pools and the console's tests know them by.
    assert [b.id for b in load_settings(LOCAL).backends] == ["gpu-a", "gpu-b", "gpu-canary"]


@pytest.mark.usefixtures("clean_env")
def test_the_documented_commands_configure_three_replicas_of_one_fleet_on_ports_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[Settings] = []

    def serve(settings: Settings, loader: Any) -> int:
        started.append(settings)
        assert loader().admin.port == settings.admin.port  # a reload keeps the flag's port
        return 0

    monkeypatch.setattr("gateway.server.serve", serve)
    commands = documented("serve")
    assert len(commands) == 3
    for argv in commands:
        assert argv[:4] == ["llm-gateway", "serve", "--config", "deploy/gateway.local-fleet.toml"]
        assert main([*argv[1:3], str(ROOT / argv[3]), *argv[4:]]) == 0
    ports = [p for s in started for p in (s.port, s.admin.port)]
    assert len(set(ports)) == 6
    # Every replica fronts the documented simulators, on ports none of the replicas takes.
    [sims] = [line for line in one_host_section().splitlines() if "llm-gateway sim" in line]
    sim_ports = {int(p) for p in re.findall(r"\b80\d\d\b", sims.split(";")[0])}
    for s in started:
        assert {int(b.url.rsplit(":", 1)[1]) for b in s.backends} == sim_ports
    assert not sim_ports & set(ports)
    # One fleet: the same Redis, key prefix and fleet name, the log on it, one token.
    assert {s.fleet_store for s in started} == {"redis"}
    redis = {s.limits.redis.url.get_secret_value() for s in started}
    assert redis == {"redis://127.0.0.1:6379/0"}
    assert len({(s.limits.redis.key_prefix, s.fleet.name) for s in started}) == 1
    assert {s.admin.token.get_secret_value() for s in started if s.admin.token} == {TOKEN}
    assert all(s.admin.host == s.host == "127.0.0.1" for s in started)


def on_ports(argv: list[str], port: int, admin_port: int) -> list[str]:
    """A documented ``serve`` command on other ports (free ones), the file by its full path."""
    out = list(argv)
    out[out.index("--port") + 1] = str(port)
    out[out.index("--admin-port") + 1] = str(admin_port)
    out[out.index("--config") + 1] = str(ROOT / out[out.index("--config") + 1])
    return out


@pytest.fixture
def simulators(tmp_path: Path) -> Iterator[list[Any]]:
    sims = [
        start_sim(name, ["--served-model-name", "llama"], tmp_path)
        for name in ("gpu-a", "gpu-b", "gpu-canary")
    ]
    try:
        yield sims
    finally:
        stop_all(sims)


@pytest.mark.slow
async def test_two_replicas_started_as_documented_apply_each_others_drains(
    tmp_path: Path, redis_url: str, redis_prefix: str, simulators: list[Any]
) -> None:
    urls = [await wait_sim_url(s) for s in simulators]
    env = {  # the file's addresses, moved to this test's simulators and Redis keys
        "GATEWAY_ADMIN__TOKEN": TOKEN,
        "GATEWAY_BACKENDS": json.dumps(
            [{"url": u, "name": s.name} for u, s in zip(urls, simulators, strict=True)]
        ),
        "GATEWAY_LIMITS__REDIS__URL": redis_url,
        "GATEWAY_LIMITS__REDIS__KEY_PREFIX": redis_prefix,
    }
    replicas, admins = [], []
    try:
        for i, argv in enumerate(documented("serve")[:2]):
            port, admin_port = free_port(), free_port()
            cmd = [*gateway_cli(), *on_ports(argv[1:], port, admin_port)]
            url = f"http://127.0.0.1:{port}"
            replicas.append(spawn(f"replica-{i}", cmd, tmp_path, env=env, url=url))
            admins.append(f"http://127.0.0.1:{admin_port}")
        for r in replicas:
            await wait_ok(r, "/ready")
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession(headers=auth) as s:

            async def draining(admin: str) -> bool:
                async with s.get(admin + "/admin/backends") as r:
                    assert r.status == 200, await r.text()
                    doc = await r.json()
                return next(b["draining"] for b in doc["backends"] if b["id"] == "gpu-b")

            async with s.post(admins[0] + "/admin/backends/gpu-b/drain") as r:
                assert r.status == 200, await r.text()
            await poll(lambda: draining(admins[1]), bool, what="the drain on the other replica")
            async with s.post(admins[1] + "/admin/backends/gpu-b/undrain") as r:
                assert r.status == 200, await r.text()
            await poll(
                lambda: draining(admins[0]),
                lambda d: not d,
                what="the undrain on the first replica",
            )
    finally:
        stop_all(replicas)
