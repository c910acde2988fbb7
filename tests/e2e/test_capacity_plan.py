"""``llm-gateway plan``'s KV-cache arithmetic against what a real vLLM server reports at start."""

from __future__ import annotations

import re

import pytest

from tests.e2e.servers import MAX_MODEL_LEN, MODEL_DIR, VllmServer
from tools.plan.arithmetic import GiB, vllm_kv_cache_report
from tools.plan.model import load_config_file, shape_from_config

pytestmark = pytest.mark.e2e

_REPORT = re.compile(
    r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: "
    r"([\d.]+)x"
)


def test_planned_kv_cache_matches_the_servers_own_startup_report(
    vllm_servers: list[VllmServer],
) -> None:
    raw, name = load_config_file(MODEL_DIR / "config.json")
    shape = shape_from_config(raw, name=name)
    # The servers run with VLLM_CPU_KVCACHE_SPACE=1 (GiB), the CPU backend's 128-token blocks
    # and a bf16 cache (tests/e2e/servers.py).
    planned = vllm_kv_cache_report(shape, 1 * GiB, block_size=128, kv_bytes=2,
                                   max_model_len=MAX_MODEL_LEN)  # fmt: skip
    for server in vllm_servers:
        match = _REPORT.search(server.log())
        assert match, f"no KV cache report in {server.log_path}"
        tokens, length, concurrency = match.groups()
        assert int(length.replace(",", "")) == MAX_MODEL_LEN
        assert int(tokens.replace(",", "")) == planned.num_tokens
        assert float(concurrency) == pytest.approx(planned.max_concurrency, abs=0.005)
