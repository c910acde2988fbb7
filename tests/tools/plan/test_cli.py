"""``llm-gateway plan`` end to end: options in, text and exit code out."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import gateway.cli
from tests.tools.plan.configs import LLAMA2_7B, LLAMA2_70B, MIXTRAL_8X7B, tiny_llama
from tools.plan import cli as plan_cli


def main(argv: Sequence[str]) -> int:
    """The subcommand alone (the registration in gateway.cli is tested once, below), so
    these tests do not depend on the other subcommands importing cleanly."""
    assert argv[0] == "plan"
    parser = argparse.ArgumentParser(prog="llm-gateway plan")
    plan_cli.add_arguments(parser)
    return plan_cli.run(parser.parse_args(argv[1:]))


def write(tmp_path: Path, raw: dict[str, Any]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return str(path)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["plan", *argv, "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_json_has_the_key_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path, LLAMA2_70B)
    out = run_json(
        capsys, cfg, "--gpus", "8", "--avg-prompt-tokens", "1000", "--avg-output-tokens", "300",
        "--concurrency", "200",
    )  # fmt: skip
    # the figures worked by hand in test_arithmetic.py
    assert out["parameters"]["total"] == 68_976_648_192
    assert out["weights"]["total_bytes"] == 137_953_296_384
    assert out["kv_cache"]["bytes_per_token_per_card"] == 81_920
    assert out["kv_cache"]["free_bytes_per_card"] == 40_673_603_584
    assert out["kv_cache"]["num_blocks_per_card"] == 31_031
    assert out["capacity"]["seqs_at_max_model_len"] == 121
    assert out["capacity"]["seqs_at_avg_len"] == 378
    assert out["capacity"]["would_preempt"] is False
    assert out["engine_args"] == {
        "tensor-parallel-size": 4,
        "gpu-memory-utilization": 0.9,
        "max-num-seqs": 378,
        "max-model-len": 4096,
        "block-size": 16,
        "dtype": "float16",  # from the config's torch_dtype
    }
    assert out["vllm_command"].startswith("vllm serve meta-llama/Llama-2-70b-hf ")
    assert [o["tensor_parallel_size"] for o in out["options"]] == [1, 2, 4, 8]
    assert "replicas: 2" in out["kubernetes"]
    assert "vllm-1:" in out["compose"]
    assert "vllm-2:" not in out["compose"]


def test_architecture_as_options_without_a_config(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys, "--name", "llama-7b", "--layers", "32", "--hidden-size", "4096", "--heads", "32",
        "--intermediate-size", "11008", "--vocab-size", "32000", "--max-model-len", "4096",
        "--dtype", "fp16",
    )  # fmt: skip
    assert out["parameters"]["total"] == 6_738_415_616
    assert out["kv_cache"]["num_blocks_per_card"] == 7_353


def test_moe_int4_fp8_kv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys, write(tmp_path, MIXTRAL_8X7B), "--dtype", "int4", "--kv-cache-dtype", "fp8"
    )
    assert out["weights"]["total_bytes"] == 23_746_584_576
    assert out["kv_cache"]["num_blocks_per_card"] == 49_033
    assert out["engine_args"]["kv-cache-dtype"] == "fp8"
    assert any("int4" in note for note in out["notes"])


def test_table_output_shows_the_working(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["plan", write(tmp_path, LLAMA2_7B), "--concurrency", "100"]) == 0
    out = capsys.readouterr().out
    assert "2 x 32 layers x 32 KV heads x 128 x 2 B" in out
    assert "would preempt" in out  # 100 > 28 sequences of 4,096 tokens
    assert "vllm serve meta-llama/Llama-2-7b-hf --tensor-parallel-size 1" in out
    assert "Approximations" in out


@pytest.mark.parametrize("fmt", ["flags", "compose", "k8s"])
def test_single_snippet_formats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    assert main(["plan", write(tmp_path, tiny_llama()), "--format", fmt]) == 0
    out = capsys.readouterr().out
    assert "--max-model-len 16384" in out or '"16384"' in out


def test_help_through_the_console_script_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gateway.cli.main(["plan", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--gpu-memory-utilization" in out
    assert "--request-rate" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{missing}"], "no such file"),
        (["{no_ffn}"], "'intermediate_size'"),
        (["{seventy}", "--gpus", "1"], "cannot fit on 1 card"),
        (["{seventy}", "--gpus", "8", "--tensor-parallel-size", "3"], "not usable"),
        (["{seventy}", "--max-model-len", "8192"], "max_position_embeddings"),
        (["{seventy}", "--gpus", "8", "--request-rate", "5"], "--avg-prompt-tokens"),
        (["{seventy}", "--gpus", "8", "--gpu-memory-utilization", "1.5"], "utilization"),
        (["{seventy}", "--gpus", "0"], "--gpus must be positive"),
        (["--layers", "2"], "missing --hidden-size"),
        ([], "missing --layers, --hidden-size, --heads, --intermediate-size, --vocab-size"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    paths = {
        "missing": str(tmp_path / "absent.json"),
        "no_ffn": str(tmp_path / "no_ffn.json"),
        "seventy": str(tmp_path / "seventy.json"),
    }
    Path(paths["no_ffn"]).write_text(
        json.dumps({k: v for k, v in LLAMA2_7B.items() if k != "intermediate_size"})
    )
    Path(paths["seventy"]).write_text(json.dumps(LLAMA2_70B))
    assert main(["plan", *(a.format(**paths) for a in argv)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("llm-gateway plan: ")
    assert message in captured.err
    assert "Traceback" not in captured.err


def test_unknown_dtype_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--dtype", "int3"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_json_request_rate_reports_the_latency_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_json(
        capsys, write(tmp_path, LLAMA2_7B), "--avg-prompt-tokens", "1000",
        "--avg-output-tokens", "300", "--request-rate", "10",
    )  # fmt: skip
    # worked in test_arithmetic.py: W = 3.4772 s, L = ceil(10 x 3.4772) = 35
    assert out["capacity"]["latency"]["total_s"] == pytest.approx(3.4772, rel=1e-4)
    assert out["capacity"]["demand_per_replica"] == 35
    assert any("Little's law" in note for note in out["notes"])


def test_every_flag_an_error_names_exists() -> None:
    """The message for a missing architecture named flags that did not exist (issue 23)."""
    from tools.plan.model import OVERRIDABLE, flag_of

    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    known = {opt for action in parser._actions for opt in action.option_strings}
    assert [flag_of(f) for f in OVERRIDABLE if flag_of(f) not in known] == []


def test_the_snippets_default_to_the_vllm_image_compose_pins() -> None:
    from tools.plan.render import DEFAULT_IMAGE

    compose = (Path(__file__).parents[3] / "compose.yaml").read_text()
    assert f"${{VLLM_IMAGE:-{DEFAULT_IMAGE}}}" in compose
