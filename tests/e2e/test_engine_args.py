"""The engine arguments compose.yaml and deploy/k8s give vLLM are ones vLLM 0.32 accepts.

They are parsed by vLLM's own argument parser from the vLLM virtualenv, so a renamed or
removed flag (``--swap-space`` went with the V1 engine) fails here instead of at a GPU
server's start-up.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from tests.deploy.manifests import compose_vllm_args, flags, k8s_vllm_args
from tests.e2e.servers import vllm_python

PARSE = """
import contextlib, io, json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

out = []
for argv in json.loads(sys.argv[1]):
    parser = make_arg_parser(FlexibleArgumentParser())
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(argv)
    except SystemExit:
        out.append({"error": err.getvalue()})
        continue
    out.append({k: v for k, v in vars(ns).items() if isinstance(v, (bool, int, float, str))})
print("PARSED " + json.dumps(out))
"""
BAD = ["--model=m", "--swap-space=4"]


def parse_with_vllm(*argvs: list[str]) -> list[dict[str, Any]]:
    """Each argv as vLLM's own parser reads it: its namespace, or ``{"error": usage text}``."""
    done = subprocess.run(
        [str(vllm_python()), "-c", PARSE, json.dumps(argvs)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [ln for ln in done.stdout.splitlines() if ln.startswith("PARSED ")]
    parsed: list[dict[str, Any]] = json.loads(line.removeprefix("PARSED "))
    return parsed


def test_vllm_accepts_the_deployed_engine_arguments() -> None:
    compose_argv, k8s_argv = compose_vllm_args(), k8s_vllm_args()
    compose_ns, k8s_ns, bad = parse_with_vllm(compose_argv, k8s_argv, BAD)
    # Not vacuous: vLLM 0.32 refuses a flag it does not know.
    assert "unrecognized arguments: --swap-space=4" in bad["error"]
    for argv, ns in ((compose_argv, compose_ns), (k8s_argv, k8s_ns)):
        assert "error" not in ns, ns.get("error")
        given = flags(argv)
        assert ns["model"] == given["--model"]
        assert ns["port"] == 8000
        assert ns["enable_prefix_caching"] is True
        assert ns["block_size"] == int(given["--block-size"] or 0)
        assert ns["max_num_seqs"] == int(given["--max-num-seqs"] or 0)
        assert ns["max_model_len"] == int(given["--max-model-len"] or 0)
        assert ns["max_num_batched_tokens"] == int(given["--max-num-batched-tokens"] or 0)
        assert ns["tensor_parallel_size"] == int(given["--tensor-parallel-size"] or 0)
        assert ns["gpu_memory_utilization"] == float(given["--gpu-memory-utilization"] or 0)
        assert ns["kv_offloading_size"] == float(given["--kv-offloading-size"] or 0)
