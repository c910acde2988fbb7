"""Configs shaped like real models' Hugging Face ``config.json`` (only the fields we read)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

LLAMA2_7B: dict[str, Any] = {
    "_name_or_path": "meta-llama/Llama-2-7b-hf",
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}

LLAMA2_70B: dict[str, Any] = {
    "_name_or_path": "meta-llama/Llama-2-70b-hf",
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}

MIXTRAL_8X7B: dict[str, Any] = {
    "_name_or_path": "mistralai/Mixtral-8x7B-v0.1",
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def tiny_llama() -> dict[str, Any]:
    """The config scripts/build_tiny_model.py writes, read from the script itself so the two
    cannot drift (the script imports only the standard library at module level)."""
    script = Path(__file__).resolve().parents[3] / "scripts" / "build_tiny_model.py"
    spec = importlib.util.spec_from_file_location("build_tiny_model", script)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {
        **module.MODEL,
        "model_type": "llama",
        "vocab_size": module.VOCAB_SIZE,
        "torch_dtype": "bfloat16",
    }
