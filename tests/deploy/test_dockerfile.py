"""The gateway's Dockerfile, read statically (there is no Docker engine in CI)."""

from __future__ import annotations

import json
import re
import tomllib

from gateway.cli import build_parser
from gateway.config.settings import Settings
from tests.deploy.manifests import DOCKERFILE, ROOT, compose


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def test_runtime_image_is_slim_python() -> None:
    args = dict(
        rest.split("=", 1) for word, rest in instructions() if word == "ARG" and "=" in rest
    )
    base = final_stage()[0][1]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert re.fullmatch(r"python:3\.1[1-9]-slim", base), base


def test_runs_as_a_non_root_user() -> None:
    [user] = [rest for word, rest in final_stage() if word == "USER"]
    assert user.split(":")[0] not in {"root", "0"}
    user_at = [w for w, _ in final_stage()].index("USER")
    entry_at = [w for w, _ in final_stage()].index("ENTRYPOINT")
    assert user_at < entry_at


def test_entrypoint_serves_the_gateway_on_its_port() -> None:
    stage = dict(final_stage())
    assert json.loads(stage["ENTRYPOINT"]) == ["llm-gateway"]
    cmd = json.loads(stage["CMD"])
    assert cmd == ["serve"]
    assert build_parser(cmd).parse_args(cmd).command == "serve"
    port = Settings.model_fields["port"].default
    assert stage["EXPOSE"] == str(port)
    assert f"GATEWAY_PORT={port}" in stage["ENV"].split()
    assert "GATEWAY_HOST=0.0.0.0" in stage["ENV"].split()
    assert f"127.0.0.1:{port}/health" in stage["HEALTHCHECK"]


def test_copies_every_package_the_project_installs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {rest.split()[0] for word, rest in instructions() if word == "COPY"}
    assert packages <= copied
    assert {"pyproject.toml", "README.md"} <= set(
        " ".join(rest for word, rest in instructions() if word == "COPY").split()
    )


def test_dockerignore_keeps_virtualenvs_and_models_out_of_the_context() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".venv-vllm", ".cache"} <= ignored


def test_compose_builds_this_image() -> None:
    services = compose()["services"]
    for name in ("gateway", "sim", "gateway-pd", "sim-prefill-0", "sim-decode-0"):
        # the Dockerfile's base, python:3.11-slim unless PYTHON_IMAGE names a local one
        assert services[name]["build"] == {
            "context": ".",
            "args": {"PYTHON_IMAGE": "python:3.11-slim"},
        }, name
    assert services["sim"]["image"] == services["gateway"]["image"]
