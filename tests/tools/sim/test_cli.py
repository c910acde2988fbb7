"""``llm-gateway sim``: vLLM-named options map onto SimConfig/Faults; the process serves
and exits cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import urllib.request

import pytest

from tools.sim import SimConfig
from tools.sim.cli import add_arguments, config_from_args, faults_from_args, run


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_are_simconfig_defaults() -> None:
    assert config_from_args(parse()) == SimConfig()


def test_vllm_named_options() -> None:
    args = parse(
        "--model", "m", "--served-model-name", "served", "--max-num-seqs", "8",
        "--block-size", "32", "--max-model-len", "1024", "--max-num-batched-tokens", "512",
        "--num-gpu-blocks-override", "100", "--no-enable-prefix-caching",
        "--enable-request-id-headers", "--sim-step-base-ms", "5", "--admin-token", "t",
        "--slowdown", "2", "--hang-after-tokens", "4", "--unhealthy",
    )  # fmt: skip
    config = config_from_args(args)
    assert config.model_name == "served"
    assert (config.max_num_seqs, config.block_size, config.max_model_len) == (8, 32, 1024)
    assert config.max_num_batched_tokens == 512
    assert config.num_gpu_blocks_override == 100
    assert not config.enable_prefix_caching
    assert config.enable_request_id_headers
    assert config.step_base_ms == 5.0
    assert config.admin_token == "t"
    faults = faults_from_args(args)
    assert (faults.slowdown, faults.hang_after_tokens, faults.unhealthy) == (2.0, 4, True)


def test_scale_out_and_prompt_tokens_details_options() -> None:
    config = config_from_args(parse("--enable-scale-out", "--enable-prompt-tokens-details"))
    assert config.enable_scale_out
    assert config.enable_prompt_tokens_details
    assert not config_from_args(parse()).enable_scale_out


def test_mid_stream_fault_options() -> None:
    faults = faults_from_args(parse("--break-after-tokens", "12", "--error-after-tokens", "0"))
    assert (faults.break_after_tokens, faults.error_after_tokens) == (12, 0)
    assert faults_from_args(parse()).break_after_tokens is None
    assert faults_from_args(parse()).error_after_tokens is None


def test_negative_fault_options_exit_with_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(parse("--break-after-tokens", "-1")) == 2
    assert "break_after_tokens must not be negative" in capsys.readouterr().err
    assert run(parse("--error-after-tokens", "-3")) == 2
    assert "error_after_tokens must not be negative" in capsys.readouterr().err


def test_bad_options_exit_with_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(parse("--max-model-len", "100000")) == 2
    assert "KV cache" in capsys.readouterr().err


def test_the_console_command_serves_until_sigterm() -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "gateway", "sim", "--port", "0", "--max-num-seqs", "4"],
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            match = re.search(r"on (http://\S+)", line)
            assert match, line
            with urllib.request.urlopen(f"{match.group(1)}/version", timeout=5) as resp:
                assert json.load(resp) == {"version": "0.32.0"}
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
        finally:
            proc.kill()
