"""What the peer bench runs: the targets (command templates), the two backend profiles, and
how a target gets installed and named.

A target is a command template. The driver substitutes the placeholders, starts it on the
proxy's CPU in its own process group, waits until ``POST {target}/v1/chat/completions``
(model ``tiny``, non-streaming) returns 200, and stops it with SIGTERM to that group afterwards.

Placeholders (commands, ``files`` and ``env`` alike):
  {port} proxy listen port      {aux_port} a spare port (metrics etc.)
  {backends} "http://127.0.0.1:P1 http://127.0.0.1:P2"   {backends_csv} same, comma-separated
  {backend_hostports} "127.0.0.1:P1 127.0.0.1:P2"        {backend_ports} "P1 P2"
  {model} served model name     {workdir} per-run scratch dir (``files`` are written there)
  {venv} this target's venv     {api_key} the target's bearer key, if any
  {python} the driver's Python  {repo} this checkout   {repo_python} the Python that runs it
  {nginx_upstream_servers} / {litellm_model_list}: pre-rendered snippets

The peers are installed by ``--install`` (pip into ``{venv}``, apt for nginx); the
repository's own targets (``gw``, the gateway, and the floors of ``scripts/proxy_cost``:
``raw``, ``bare``, ``lean``) run from this checkout under ``--repo-python``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

from loadtest.peers.procs import sh

REPO: Final = str(Path(__file__).resolve().parents[2])

NGINX_CONF: Final = """\
worker_processes 1;
daemon off;
master_process on;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
worker_rlimit_nofile 65536;
events {{ worker_connections 16384; multi_accept on; }}
http {{
  access_log off;
  client_body_temp_path {workdir}/client_body;
  proxy_temp_path {workdir}/proxy_temp;
  fastcgi_temp_path {workdir}/fastcgi_temp;
  uwsgi_temp_path {workdir}/uwsgi_temp;
  scgi_temp_path {workdir}/scgi_temp;
  tcp_nodelay on;
  keepalive_requests 1000000;
  upstream backends {{
    least_conn;
{nginx_upstream_servers}
    keepalive 1024;
  }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://backends;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_cache off;
      proxy_read_timeout 600s;
      proxy_send_timeout 600s;
    }}
  }}
}}
"""

LITELLM_YAML: Final = """\
model_list:
{litellm_model_list}
litellm_settings:
  telemetry: false
  drop_params: true
  set_verbose: false
  request_timeout: 600
  num_retries: 0
router_settings:
  routing_strategy: simple-shuffle
general_settings:
  master_key: {api_key}
  disable_spend_logs: true
  disable_error_logs: true
"""

# The repository's version, for the targets that run from it.
_REPO_VERSION: Final = f"git -C {shlex.quote(REPO)} describe --always --dirty"
_PROXY_COST: Final = "{repo}/scripts/proxy_cost"

BUILTIN_TARGETS: Final[dict[str, dict[str, Any]]] = {
    "direct": {
        "cmd": None,  # loadgen talks to the backends itself (workers alternate)
        "note": "no proxy; loadgen alternates between the two backends",
    },
    "nginx": {
        "apt": "nginx",
        "version_cmd": "nginx -v",
        "files": {"nginx.conf": NGINX_CONF},
        "cmd": "nginx -p {workdir} -c {workdir}/nginx.conf",
        "note": "1 worker process, least_conn upstream, keepalive 1024, proxy_buffering off",
    },
    "vllm-router": {
        "pip": "vllm-router",
        "dist": "vllm-router",
        "cmd": (
            "{venv}/bin/vllm-router --host 127.0.0.1 --port {port} --worker-urls {backends} "
            "--policy round_robin --prometheus-port {aux_port} --log-level warning"
        ),
    },
    "sglang-router": {
        "pip": "sglang-router",
        "dist": "sglang-router",
        "cmd": (
            "{venv}/bin/python -m sglang_router.launch_router --host 127.0.0.1 --port {port} "
            "--worker-urls {backends} --policy round_robin --prometheus-port {aux_port} "
            "--log-level warn"
        ),
    },
    "litellm": {
        "pip": "litellm[proxy]",
        "dist": "litellm",
        "files": {"litellm.yaml": LITELLM_YAML},
        "env": {
            "LITELLM_TELEMETRY": "False",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
            "HF_HUB_OFFLINE": "1",
            "DISABLE_ADMIN_UI": "True",
            "LITELLM_DONT_SHOW_FEEDBACK_BOX": "True",
        },
        "cmd": (
            "{venv}/bin/litellm --config {workdir}/litellm.yaml --host 127.0.0.1 --port {port} "
            "--num_workers 1"
        ),
        "api_key": "sk-bench-0123456789abcdef",
        "ready_timeout": 180,
        "note": (
            "hosted_vllm/ provider, simple-shuffle routing, master_key auth, no DB, "
            "1 uvicorn worker"
        ),
    },
    # The floors of docs/proxy-cost.md, each a layer of the gateway's stack with nothing above.
    "raw": {
        "version_cmd": _REPO_VERSION,
        "cmd": "{repo_python} " + _PROXY_COST + "/raw_proxy.py {port} {backend_ports}",
        "note": "scripts/proxy_cost/raw_proxy.py: a byte splice on uvloop, no HTTP",
    },
    "lean": {
        "version_cmd": _REPO_VERSION,
        "env": {"PYTHONPATH": "{repo}"},
        "cmd": "{repo_python} " + _PROXY_COST + "/lean_proxy.py {port} {backend_ports}",
        "note": "scripts/proxy_cost/lean_proxy.py: httptools server + backends.upstream.h1",
    },
    "bare": {
        "version_cmd": _REPO_VERSION,
        "env": {"PYTHONPATH": "{repo}"},
        "cmd": "{repo_python} " + _PROXY_COST + "/bare_proxy.py {port} {backend_ports}",
        "note": "scripts/proxy_cost/bare_proxy.py: aiohttp's server + backends.upstream.h1",
    },
    "gw": {
        "version_cmd": _REPO_VERSION,
        "env": {"PYTHONPATH": "{repo}"},
        "cmd": (
            "{repo_python} -m gateway serve --host 127.0.0.1 --port {port} "
            "--backends {backends_csv}"
        ),
        "ready_timeout": 120,
        "note": "this checkout's gateway, default settings (one worker, info-level log lines)",
    },
}

PROFILES: Final[dict[str, dict[str, Any]]] = {
    # name: backend args, loadgen max_tokens
    "fast": {
        "ttft_ms": 0,
        "itl_ms": 0,
        "max_tokens": 256,
        "desc": "itl 0 ms, max_tokens 256: raw forwarding cost (events/s)",
    },
    "paced": {
        "ttft_ms": 20,
        "itl_ms": 10,
        "max_tokens": 64,
        "desc": "ttft 20 ms, itl 10 ms, max_tokens 64: added TTFT and jitter",
    },
}


def default_repo_python() -> str:
    """The checkout's own virtualenv where there is one, else the Python running the driver."""
    venv = os.path.join(REPO, ".venv", "bin", "python")
    return venv if os.path.exists(venv) else sys.executable


def render_ctx(
    args: argparse.Namespace,
    name: str,
    workdir: str,
    backends_ports: list[int],
    spec_api_key: str = "",
) -> dict[str, Any]:
    urls = [f"http://127.0.0.1:{p}" for p in backends_ports]
    return {
        "port": args.proxy_port,
        "aux_port": args.proxy_port + 1,
        "backends": " ".join(urls),
        "backends_csv": ",".join(urls),
        "backend_hostports": " ".join(f"127.0.0.1:{p}" for p in backends_ports),
        "backend_ports": " ".join(str(p) for p in backends_ports),
        "model": args.model,
        "workdir": workdir,
        "venv": os.path.join(args.venvs, name),
        "nginx_upstream_servers": "\n".join(
            f"    server 127.0.0.1:{p} max_fails=0;" for p in backends_ports
        ),
        "litellm_model_list": "\n".join(
            f"  - model_name: {args.model}\n    litellm_params:\n"
            f"      model: hosted_vllm/{args.model}\n"
            f"      api_base: http://127.0.0.1:{p}/v1\n      api_key: dummy"
            for p in backends_ports
        ),
        "python": sys.executable,
        "repo": REPO,
        "repo_python": args.repo_python,
        "api_key": spec_api_key,
    }


def ensure_installed(
    name: str, spec: dict[str, Any], args: argparse.Namespace, logdir: str
) -> tuple[bool, str]:
    """Returns (ok, message)."""
    lp = os.path.join(logdir, f"install-{name}.log")
    if spec.get("apt"):
        if shutil.which(spec["apt"]):
            return True, "present"
        if not args.install:
            return False, f"{spec['apt']} not installed (use --install)"
        r = sh("apt-get update && apt-get install -y " + spec["apt"], log_path=lp)
        ok = r.returncode == 0 and shutil.which(spec["apt"]) is not None
        return ok, f"apt-get rc={r.returncode}"
    if spec.get("pip"):
        venv = os.path.join(args.venvs, name)
        marker = os.path.join(venv, ".bench-installed")
        if os.path.exists(marker):
            return True, "present"
        dist = spec.get("dist")
        if dist and os.path.exists(os.path.join(venv, "bin", "python")):
            r = sh(f"{venv}/bin/python -c {shlex.quote(_version_snippet(dist))}", timeout=60)
            if r.returncode == 0:
                Path(marker).write_text("pre-existing\n")
                return True, "present"
        if not args.install:
            return False, f"venv {venv} missing (use --install)"
        t0 = time.time()
        try:
            r = sh(
                f"{shlex.quote(sys.executable)} -m venv {shlex.quote(venv)} && "
                f"{shlex.quote(venv)}/bin/pip install {shlex.quote(spec['pip'])}",
                timeout=args.install_timeout,
                log_path=lp,
            )
        except subprocess.TimeoutExpired:
            return False, f"pip install timed out after {args.install_timeout}s"
        if r.returncode != 0:
            return False, "pip install failed: " + (r.stderr or r.stdout)[-400:]
        Path(marker).write_text(f"{time.time() - t0:.0f}s\n")
        return True, f"installed in {time.time() - t0:.0f}s"
    return True, "nothing to install"


def _version_snippet(dist: str) -> str:
    return f"import importlib.metadata as m; print(m.version({dist!r}))"


def version_of(name: str, spec: dict[str, Any], args: argparse.Namespace) -> str | None:
    try:
        if spec.get("version_cmd"):
            r = sh(spec["version_cmd"], timeout=30)
            return (r.stdout + r.stderr).strip().splitlines()[-1]
        if spec.get("dist"):
            py = os.path.join(args.venvs, name, "bin", "python")
            r = sh(f"{py} -c {shlex.quote(_version_snippet(spec['dist']))}", timeout=60)
            return f"{spec['dist']} {r.stdout.strip()}" if r.returncode == 0 else "unknown"
        if spec.get("version"):
            return str(spec["version"])
    except Exception as e:
        return f"unknown ({e})"
    return None
