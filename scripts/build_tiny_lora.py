"""Write a random LoRA adapter for the tiny model (PEFT's layout), for the end-to-end tests.

    .venv-vllm/bin/python scripts/build_tiny_lora.py --model .cache/tiny-llama --out DIR [--seed N]

Rank 8 on every layer's q_proj and v_proj, shapes read from the model's config.json;
``adapter_config.json`` and ``adapter_model.safetensors`` (written with ``safetensors``), as
vLLM's ``--lora-modules`` and ``/v1/load_lora_adapter`` read them. No network, no peft.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

RANK = 8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="the tiny model's directory")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = json.loads((args.model / "config.json").read_text())
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    outs = {
        "q_proj": cfg["num_attention_heads"] * head_dim,
        "v_proj": cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim,
    }
    rng = np.random.default_rng(args.seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, out in outs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, 0.02, (RANK, hidden)).astype("f4")
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.02, (out, RANK)).astype("f4")
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(outs),
        "base_model_name_or_path": str(args.model),
        "inference_mode": True,
    }
    (args.out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    print(f"wrote {args.out}: {len(tensors)} tensors, rank {RANK}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
