"""``llm-gateway plan``: options and the runner."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Final

from gateway.helpfmt import DefaultsHelp
from tools.plan.arithmetic import KV_DTYPES, WEIGHT_BITS, GiB
from tools.plan.model import (
    OVERRIDABLE,
    PlanError,
    load_config_file,
    shape_from_config,
    shape_with_overrides,
)
from tools.plan.planner import Hardware, Plan, Workload, make_plan
from tools.plan.render import (
    DEFAULT_IMAGE,
    compose_snippet,
    kubernetes_snippet,
    print_plan,
    to_json,
    vllm_command,
)

DESCRIPTION: Final = (
    "Size a vLLM deployment: weight memory, KV cache per token/block/sequence, free KV "
    "memory per card, sequences that fit at max-model-len and at the average length, whether "
    "the expected concurrency (or request rate, via Little's law) would preempt, the smallest "
    "tensor-parallel size that fits, and the engine arguments as vLLM flags and as compose "
    "and Kubernetes snippets. Reads a Hugging Face config.json or takes the architecture as "
    "options (options override the config)."
)

_DTYPE_FROM_TORCH: Final = {"float16": "fp16", "bfloat16": "bf16", "float32": "bf16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the planner's options to ``parser``."""
    parser.formatter_class = DefaultsHelp
    parser.add_argument(
        "config", nargs="?", type=Path, help="config.json, or a model directory holding one"
    )
    arch = parser.add_argument_group("architecture (override or replace config.json)")
    arch.add_argument("--name", help="model name for the flags (default: from the config)")
    arch.add_argument(
        "--layers", dest="num_layers", type=int, metavar="N", help="transformer layers"
    )
    arch.add_argument("--hidden-size", type=int, metavar="N", help="model (embedding) width")
    arch.add_argument(
        "--heads", dest="num_attention_heads", type=int, metavar="N", help="attention heads"
    )
    arch.add_argument(
        "--kv-heads", dest="num_kv_heads", type=int, metavar="N", help="default: --heads"
    )
    arch.add_argument("--head-dim", type=int, metavar="N", help="default: hidden size / heads")
    arch.add_argument("--intermediate-size", type=int, metavar="N", help="feed-forward width")
    arch.add_argument("--vocab-size", type=int, metavar="N", help="tokens in the vocabulary")
    arch.add_argument(
        "--tie-embeddings",
        dest="tie_word_embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="input and output embeddings shared (counted once)",
    )
    arch.add_argument(
        "--experts", dest="num_experts", type=int, metavar="N", help="MoE experts per layer"
    )
    arch.add_argument("--experts-per-token", type=int, metavar="N", help="MoE top-k")
    arch.add_argument(
        "--max-position-embeddings",
        type=int,
        metavar="N",
        help="the model's context limit, if known",
    )

    hw = parser.add_argument_group("cards")
    hw.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory per card")
    hw.add_argument("--gpus", type=int, default=1, help="number of cards")
    hw.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.90,
        help="share of each card vLLM may use (vLLM's flag)",
    )
    hw.add_argument(
        "--reserve-gib",
        type=float,
        default=2.0,
        help="per-card runtime reserve: activations, CUDA context, CUDA graphs (estimate)",
    )
    hw.add_argument("--gpu-bandwidth-gbps", type=float, default=2000.0, help="GB/s, latency only")
    hw.add_argument("--gpu-tflops", type=float, default=312.0, help="16-bit TFLOP/s, latency only")
    hw.add_argument("--tensor-parallel-size", type=int, help="force a TP size (default: choose)")

    prec = parser.add_argument_group("precision")
    prec.add_argument(
        "--dtype",
        choices=["auto", *WEIGHT_BITS],
        default="auto",
        help="weights; auto: the config's torch_dtype (fp32 served as bf16)",
    )
    prec.add_argument(
        "--kv-cache-dtype", choices=KV_DTYPES, default="auto", help="auto: 16-bit (fp32: 32)"
    )

    wl = parser.add_argument_group("workload")
    wl.add_argument(
        "--max-model-len", type=int, help="default: the config's max_position_embeddings"
    )
    wl.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    wl.add_argument("--avg-prompt-tokens", type=int, help="mean prompt length of the traffic")
    wl.add_argument("--avg-output-tokens", type=int, help="mean answer length of the traffic")
    demand = wl.add_mutually_exclusive_group()
    demand.add_argument("--concurrency", type=int, help="requests in flight, all replicas")
    demand.add_argument("--request-rate", type=float, help="requests/s, all replicas")
    wl.add_argument(
        "--latency-s", type=float, help="measured seconds per request (replaces the estimate)"
    )

    out = parser.add_argument_group("output")
    out.add_argument(
        "--format",
        choices=["table", "json", "flags", "compose", "k8s"],
        default="table",
        help="table: the working, flags and snippets",
    )
    out.add_argument("--json", action="store_true", help="same as --format json")
    out.add_argument("--image", default=DEFAULT_IMAGE, help="container image for the snippets")


def _weight_dtype(requested: str, torch_dtype: str | None) -> str:
    if requested != "auto":
        return requested
    return _DTYPE_FROM_TORCH.get(torch_dtype or "", "bf16")


def _positive(value: float | None, flag: str) -> None:
    if value is not None and value <= 0:
        raise PlanError(f"{flag} must be positive, got {value:g}")


def _build(args: argparse.Namespace) -> Plan:
    base = None
    name = args.name or "model"
    if args.config is not None:
        raw, config_name = load_config_file(args.config)
        name = args.name or config_name
        base = shape_from_config(raw, name=name, where=str(args.config))
    fields = {k: getattr(args, k) for k in OVERRIDABLE}
    shape = shape_with_overrides(base, name, **fields)
    if args.max_position_embeddings is not None:
        shape = replace(shape, max_position_embeddings=args.max_position_embeddings)
    max_len = args.max_model_len or shape.max_position_embeddings
    if max_len is None:
        raise PlanError("give --max-model-len (the config has no max_position_embeddings)")
    for value, flag in (
        (args.gpu_memory_gib, "--gpu-memory-gib"),
        (args.gpus, "--gpus"),
        (args.gpu_bandwidth_gbps, "--gpu-bandwidth-gbps"),
        (args.gpu_tflops, "--gpu-tflops"),
        (args.latency_s, "--latency-s"),
        (args.block_size, "--block-size"),
        (args.max_model_len, "--max-model-len"),
        (args.tensor_parallel_size, "--tensor-parallel-size"),
    ):
        _positive(value, flag)
    for value, flag in (
        (args.avg_prompt_tokens, "--avg-prompt-tokens"),
        (args.avg_output_tokens, "--avg-output-tokens"),
    ):
        if value is not None and value < 0:
            raise PlanError(f"{flag} cannot be negative")
    plan = make_plan(
        shape,
        weight_dtype=_weight_dtype(args.dtype, shape.torch_dtype),
        kv_dtype=args.kv_cache_dtype,
        hardware=Hardware(
            card_bytes=int(args.gpu_memory_gib * GiB),
            num_cards=args.gpus,
            utilization=args.gpu_memory_utilization,
            reserve_bytes=int(args.reserve_gib * GiB),
            bandwidth_bytes_per_s=args.gpu_bandwidth_gbps * 1e9,
            flops=args.gpu_tflops * 1e12,
        ),
        workload=Workload(
            max_model_len=max_len,
            block_size=args.block_size,
            avg_prompt_tokens=args.avg_prompt_tokens,
            avg_output_tokens=args.avg_output_tokens,
            concurrency=args.concurrency,
            request_rate=args.request_rate,
            latency_s=args.latency_s,
        ),
        tp=args.tensor_parallel_size,
    )
    return plan


def run(args: argparse.Namespace) -> int:
    """Print the plan; 2 with a message on stderr for input it cannot plan for."""
    from rich.console import Console

    try:
        plan = _build(args)
    except PlanError as exc:
        print(f"llm-gateway plan: {exc}", file=sys.stderr)
        return 2
    fmt = "json" if args.json else args.format
    if fmt == "json":
        print(json.dumps(to_json(plan, args.image), indent=2))
    elif fmt == "flags":
        print(vllm_command(plan))
    elif fmt == "compose":
        print(compose_snippet(plan, args.image))
    elif fmt == "k8s":
        print(kubernetes_snippet(plan, args.image))
    else:
        print_plan(plan, Console(), args.image)
    return 0
