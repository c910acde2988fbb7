"""Reading the architecture from config.json or from options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tools.plan.configs import LLAMA2_70B, MIXTRAL_8X7B, tiny_llama
from tools.plan.model import (
    PlanError,
    load_config_file,
    shape_from_config,
    shape_with_overrides,
)


def test_gqa_config_reads_kv_heads_and_derives_head_dim() -> None:
    s = shape_from_config(LLAMA2_70B, name="70b")
    # 8,192 hidden / 64 heads = 128 per head; 8 KV heads
    assert (s.num_kv_heads, s.head_dim, s.num_layers) == (8, 128, 80)
    assert s.torch_dtype == "float16"
    assert not s.is_moe


def test_missing_kv_heads_means_multi_head_attention() -> None:
    raw = {k: v for k, v in LLAMA2_70B.items() if k != "num_key_value_heads"}
    assert shape_from_config(raw, name="m").num_kv_heads == 64


def test_moe_config_reads_experts() -> None:
    s = shape_from_config(MIXTRAL_8X7B, name="mixtral")
    assert (s.num_experts, s.experts_per_token, s.is_moe) == (8, 2, True)
    assert s.sliding_window is None


def test_tiny_model_has_explicit_head_dim_and_tied_embeddings() -> None:
    s = shape_from_config(tiny_llama(), name="tiny")
    assert (s.hidden_size, s.num_attention_heads, s.num_kv_heads, s.head_dim) == (128, 2, 1, 64)
    assert s.tie_word_embeddings


def test_transformers_5_dtype_key_is_read() -> None:
    raw = {**LLAMA2_70B, "dtype": "bfloat16"}
    del raw["torch_dtype"]
    assert shape_from_config(raw, name="m").torch_dtype == "bfloat16"


def test_missing_field_names_the_field_and_the_flag() -> None:
    raw = {k: v for k, v in LLAMA2_70B.items() if k != "intermediate_size"}
    with pytest.raises(PlanError, match=r"'intermediate_size'.*--intermediate-size"):
        shape_from_config(raw, name="m", where="cfg.json")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kv_lora_rank": 512}, "latent attention"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "not uniform"),
        ({"num_hidden_layers": "eighty"}, "positive integer"),
        ({"num_key_value_heads": 6}, "not a multiple"),
        ({"num_local_experts": 8}, "num_experts_per_tok"),
    ],
)
def test_configs_it_cannot_interpret_are_refused(extra: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        shape_from_config({**LLAMA2_70B, **extra}, name="m")


def test_options_override_the_config() -> None:
    base = shape_from_config(LLAMA2_70B, name="70b")
    s = shape_with_overrides(base, "70b", num_kv_heads=64, num_layers=None)
    assert (s.num_kv_heads, s.num_layers) == (64, 80)


def test_architecture_from_options_alone() -> None:
    s = shape_with_overrides(
        None,
        "custom",
        num_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        intermediate_size=512,
        vocab_size=1000,
    )
    assert (s.head_dim, s.num_kv_heads, s.num_experts) == (64, 4, 0)


def test_options_alone_must_name_what_is_missing() -> None:
    with pytest.raises(PlanError, match="--intermediate-size, --vocab-size"):
        shape_with_overrides(None, "m", num_layers=4, hidden_size=256, num_attention_heads=4)


def test_load_config_file_accepts_a_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny_llama()))
    raw, name = load_config_file(tmp_path)
    assert raw["hidden_size"] == 128
    assert name == str(tmp_path)  # no _name_or_path: the directory vLLM would serve


@pytest.mark.parametrize(
    ("content", "message"), [("{not json", "not valid JSON"), ("[1, 2]", "not a JSON object")]
)
def test_load_config_file_rejects_bad_json(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(PlanError, match=message):
        load_config_file(path)


def test_load_config_file_missing(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="no such file"):
        load_config_file(tmp_path / "nope.json")
