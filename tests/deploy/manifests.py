"""Loading the deployment files the way their tools read them, for the tests that check them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Final

import yaml

ROOT: Final = Path(__file__).resolve().parents[2]
COMPOSE: Final = ROOT / "compose.yaml"
DOCKERFILE: Final = ROOT / "Dockerfile"
K8S: Final = ROOT / "deploy" / "k8s"
PROMETHEUS: Final = ROOT / "deploy" / "prometheus" / "prometheus.yml"
KUBERNETES_VERSION: Final = "1.33"  # schemas to check against (kubernetes-validate ships them)

_VAR: Final = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str] | None = None) -> Any:
    """Compose's ``${VAR}`` / ``${VAR:-default}`` substitution, with ``env`` or the defaults."""
    env = env or {}
    if isinstance(value, str):
        return _VAR.sub(lambda m: env.get(m.group(1), m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


@cache
def compose_raw() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict)
    return doc


def compose() -> dict[str, Any]:
    """compose.yaml as ``docker compose config`` sees it with no variables set."""
    return interpolate(compose_raw())  # type: ignore[no-any-return]


@cache
def compose_schema() -> dict[str, Any]:
    """The Compose Specification's JSON schema, as check-jsonschema vendors it."""
    text = (
        resources.files("check_jsonschema.builtin_schemas.vendor")
        .joinpath("compose-spec.json")
        .read_text()
    )
    return json.loads(text)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class K8sDoc:
    path: Path
    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.doc["kind"])

    @property
    def name(self) -> str:
        return str(self.doc["metadata"]["name"])

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.kind}/{self.name}"


def kustomization_files() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


@cache
def k8s_docs() -> tuple[K8sDoc, ...]:
    """Every Kubernetes object under deploy/k8s (kustomization files are not objects)."""
    docs: list[K8sDoc] = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append(K8sDoc(path, doc))
    return tuple(docs)


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    [found] = [d.doc for d in k8s_docs() if d.kind == kind and d.name == name]
    return found


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def named_port(ctr: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's target port as a number (named ports resolved)."""
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in ctr["ports"] if p.get("name") == port]
    return int(number)


def kustomize_literals(path: Path, generator: str) -> dict[str, str]:
    kustomization = yaml.safe_load(path.read_text())
    [gen] = [g for g in kustomization["configMapGenerator"] if g["name"] == generator]
    return dict(lit.split("=", 1) for lit in gen["literals"])


def flags(args: list[str]) -> dict[str, str | None]:
    """``--name=value`` / ``--name value`` / ``--switch`` arguments as a mapping."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        assert arg.startswith("--"), f"positional argument {arg!r}"
        if "=" in arg:
            name, value = arg.split("=", 1)
            out[name] = value
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[arg] = args[i + 1]
            i += 1
        else:
            out[arg] = None
        i += 1
    return out


def compose_vllm_args() -> list[str]:
    """What each compose `vllm` replica passes to ``vllm serve`` (its slot script adds TP)."""
    svc = compose()["services"]["vllm"]
    tp = svc["environment"]["TENSOR_PARALLEL_SIZE"]
    return [*svc["command"], "--tensor-parallel-size", str(tp)]


def k8s_vllm_args() -> list[str]:
    """What the StatefulSet passes to ``vllm serve``, with $(VAR) expanded as the kubelet does."""
    ctr = container(k8s_object("StatefulSet", "vllm"), "vllm")
    params = kustomize_literals(K8S / "kustomization.yaml", "vllm-params")
    return [re.sub(r"\$\((\w+)\)", lambda m: params[m.group(1)], a) for a in ctr["args"]]
