#!/usr/bin/env bash
# Entry point of every `vllm` replica in compose.yaml: claim the first free slot of
# TENSOR_PARALLEL_SIZE GPUs, then exec `vllm serve` on those GPUs with the arguments given.
#
# Docker hands every replica of a service the same devices (a device request by count always
# starts at GPU 0), so `docker compose up --scale vllm=N` would stack N servers on GPU 0.
# Instead every replica sees all GPUs and picks its own here. A slot is an flock on a file in a
# volume the replicas share; the server process holds it (fd 9) for its lifetime, so a replica
# that exits or restarts frees its slot.
set -euo pipefail

tp="${TENSOR_PARALLEL_SIZE:-1}"
locks="${GPU_LOCK_DIR:-/gpu-locks}"
mkdir -p "$locks"

if command -v nvidia-smi >/dev/null 2>&1; then
  n_gpus=$(nvidia-smi --list-gpus | wc -l)
else
  n_gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
fi

for ((slot = 0; (slot + 1) * tp <= n_gpus; slot++)); do
  exec 9>"$locks/slot-$slot.lock"
  if flock --nonblock 9; then
    first=$((slot * tp))
    CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $((first + tp - 1)))
    export CUDA_VISIBLE_DEVICES
    echo "vllm-gpu-slot: slot $slot, CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES" >&2
    exec vllm serve "$@" --tensor-parallel-size "$tp"
  fi
  exec 9>&-
done

echo "vllm-gpu-slot: all $((n_gpus / tp)) slots of $tp GPU(s) on this host are taken;" \
  "run fewer replicas (docker compose up --scale vllm=$((n_gpus / tp)))" >&2
exit 1
