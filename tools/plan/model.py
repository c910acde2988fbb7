"""A model's architecture, as the capacity arithmetic needs it.

Read from a Hugging Face ``config.json`` (Llama-style decoder-only transformers: Llama,
Mistral, Mixtral, Qwen2, Qwen2-MoE and the like) or given field by field. Pure: the only I/O
is :func:`load_config_file`, which reads the JSON and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final


class PlanError(ValueError):
    """Bad input to the planner: a missing field, an uninterpretable config, a model that
    cannot fit. The CLI prints the message and exits 2."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The architecture facts the memory arithmetic depends on."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    num_experts: int = 0  # routed experts per MoE layer; 0 for a dense model
    experts_per_token: int = 0
    moe_intermediate_size: int | None = None  # expert MLP width when it differs (Qwen2-MoE)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on shared expert
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    max_position_embeddings: int | None = None
    torch_dtype: str | None = None
    sliding_window: int | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def validate(self) -> ModelShape:
        """Raise :class:`PlanError` unless the shape is self-consistent; return it."""
        for field in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
        ):
            if getattr(self, field) <= 0:
                raise PlanError(f"{field} must be a positive integer, got {getattr(self, field)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise PlanError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.is_moe and not 1 <= self.experts_per_token <= self.num_experts:
            raise PlanError(
                f"num_experts_per_tok ({self.experts_per_token}) must be between 1 and the "
                f"number of experts ({self.num_experts})"
            )
        return self


# Keys other families use for the same facts, tried in order.
_ALIASES: Final[Mapping[str, tuple[str, ...]]] = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner"),
    "vocab_size": ("vocab_size",),
}
# Architectures whose KV cache is not 2 x kv_heads x head_dim per token per layer.
_UNSUPPORTED: Final[Mapping[str, str]] = {
    "kv_lora_rank": "multi-head latent attention (DeepSeek-style MLA) caches a compressed "
    "latent, not per-head keys and values",
    "layer_types": "the layers are not uniform (mixed attention types per layer)",
    "layers_block_type": "the layers are not uniform (hybrid attention / state-space layers)",
    "ssm_cfg": "state-space layers keep a fixed-size state, not a KV cache",
}


def _positive_int(raw: Mapping[str, Any], key: str) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"config field {key!r} must be a positive integer, got {value!r}")
    return value


def _pick(raw: Mapping[str, Any], field: str, *, where: str) -> int:
    for key in _ALIASES[field]:
        if raw.get(key) is not None:
            return _positive_int(raw, key)
    raise PlanError(
        f"{where} has no {_ALIASES[field][0]!r} (needed for {field}); give it with "
        f"--{field.replace('_', '-')}"
    )


def _optional_int(raw: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        if raw.get(key) is not None:
            return _positive_int(raw, key)
    return None


def _dtype_name(raw: Mapping[str, Any]) -> str | None:
    for key in ("torch_dtype", "dtype"):  # transformers 5 writes "dtype"
        if isinstance(raw.get(key), str):
            return str(raw[key])
    return None


def shape_from_config(raw: Mapping[str, Any], *, name: str, where: str = "config") -> ModelShape:
    """Interpret a Hugging Face ``config.json`` mapping. Raises :class:`PlanError`."""
    if not isinstance(raw, Mapping):
        raise PlanError(f"{where} is not a JSON object")
    if isinstance(raw.get("text_config"), Mapping):
        # Multimodal wrappers (Llava, Mistral3, ...) nest the language model's config.
        raw = {**raw["text_config"], "_name_or_path": raw.get("_name_or_path")}
    for key, why in _UNSUPPORTED.items():
        if raw.get(key) is not None:
            raise PlanError(f"cannot plan for this model: {why} ({where} has {key!r})")
    if isinstance(raw.get("sliding_window"), list):
        raise PlanError(f"cannot plan for this model: per-layer sliding windows ({where})")

    num_layers = _pick(raw, "num_layers", where=where)
    hidden = _pick(raw, "hidden_size", where=where)
    heads = _pick(raw, "num_attention_heads", where=where)
    kv_heads = _optional_int(raw, "num_key_value_heads", "num_kv_heads", "multi_query_group_num")
    head_dim = _optional_int(raw, "head_dim")
    if head_dim is None:
        if hidden % heads:
            raise PlanError(
                f"{where} has no 'head_dim' and hidden_size ({hidden}) is not divisible by "
                f"num_attention_heads ({heads}); give it with --head-dim"
            )
        head_dim = hidden // heads
    num_experts = _optional_int(raw, "num_local_experts", "num_experts", "n_routed_experts") or 0
    per_token = _optional_int(raw, "num_experts_per_tok", "num_experts_per_token") or 0
    if num_experts > 1 and not per_token:
        raise PlanError(f"{where} has {num_experts} experts but no 'num_experts_per_tok'")
    window = raw.get("sliding_window")
    return ModelShape(
        name=name,
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads if kv_heads is not None else heads,
        head_dim=head_dim,
        intermediate_size=_pick(raw, "intermediate_size", where=where),
        vocab_size=_pick(raw, "vocab_size", where=where),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        num_experts=num_experts if num_experts > 1 else 0,
        experts_per_token=per_token if num_experts > 1 else 0,
        moe_intermediate_size=_optional_int(raw, "moe_intermediate_size"),
        shared_expert_intermediate_size=_optional_int(raw, "shared_expert_intermediate_size") or 0,
        attention_bias=bool(raw.get("attention_bias", False))
        or raw.get("model_type") in ("qwen2", "qwen2_moe"),
        max_position_embeddings=_optional_int(raw, "max_position_embeddings", "n_positions"),
        torch_dtype=_dtype_name(raw),
        sliding_window=window if isinstance(window, int) and window > 0 else None,
    ).validate()


def load_config_file(path: Path) -> tuple[dict[str, Any], str]:
    """Read ``config.json`` (or ``<dir>/config.json``); return the mapping and the name to
    serve it by (``_name_or_path``, else the directory)."""
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanError(f"no such file: {file}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"cannot read {file}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{file} is not a JSON object")
    # vLLM serves a local model by its directory, so that is the name without _name_or_path
    name = raw.get("_name_or_path") or str(file.parent)
    return raw, str(name)


OVERRIDABLE: Final = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "num_experts",
    "experts_per_token",
)


# Fields whose command-line flag is not the field's name (``tools.plan.cli``).
_FLAGS: Final = {
    "num_layers": "--layers",
    "num_attention_heads": "--heads",
    "num_kv_heads": "--kv-heads",
    "num_experts": "--experts",
    "tie_word_embeddings": "--tie-embeddings",
}


def flag_of(field_name: str) -> str:
    """The ``llm-gateway plan`` flag that gives ``field_name``."""
    return _FLAGS.get(field_name, "--" + field_name.replace("_", "-"))


def shape_with_overrides(base: ModelShape | None, name: str, **fields: Any) -> ModelShape:
    """Apply explicitly given fields (None means not given) over ``base`` or build a shape
    from the fields alone. Raises :class:`PlanError` naming what is missing."""
    given = {k: v for k, v in fields.items() if k in OVERRIDABLE and v is not None}
    if base is not None:
        shape = replace(base, **given)
    else:
        required = ("num_layers", "hidden_size", "num_attention_heads", "intermediate_size")
        missing = [k for k in (*required, "vocab_size") if k not in given]
        if missing:
            flags = ", ".join(flag_of(k) for k in missing)
            raise PlanError(f"without a config.json, give the architecture: missing {flags}")
        if "head_dim" not in given:
            if given["hidden_size"] % given["num_attention_heads"]:
                raise PlanError("hidden size is not divisible by the heads; give --head-dim")
            given["head_dim"] = given["hidden_size"] // given["num_attention_heads"]
        given.setdefault("num_kv_heads", given["num_attention_heads"])
        shape = ModelShape(name=name, **given)
    if shape.num_experts <= 1:
        shape = replace(shape, num_experts=0, experts_per_token=0)
    elif not shape.experts_per_token:
        raise PlanError("an MoE model needs --experts-per-token")
    return shape.validate()
