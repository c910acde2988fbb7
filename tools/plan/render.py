"""A plan as text: the working as a table, JSON, vLLM flags, compose and Kubernetes YAML."""

from __future__ import annotations

import json
from typing import Any, Final

from rich.console import Console
from rich.table import Table

from tools.plan.arithmetic import WEIGHT_BITS, GiB, blocks_for, usable_bytes
from tools.plan.planner import Plan, TpOption

_TORCH_DTYPE: Final = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
DEFAULT_IMAGE: Final = "vllm/vllm-openai:v0.32.0"  # what compose.yaml and deploy/k8s pin


def _gib(n: int | float) -> str:
    return f"{n / GiB:,.2f} GiB"


def _size(n: int) -> str:
    if abs(n) >= GiB:
        return _gib(n)
    if abs(n) >= 1024**2:
        return f"{n / 1024**2:,.2f} MiB"
    if abs(n) >= 1024:
        return f"{n / 1024:,.1f} KiB"
    return f"{n:,} B"


def _billions(n: int) -> str:
    return f"{n:,} ({n / 1e9:.2f} B)" if n >= 10**8 else f"{n:,}"


def engine_args(plan: Plan) -> dict[str, int | float | str]:
    """The suggested vLLM engine arguments, by vLLM's flag names without the dashes."""
    args: dict[str, int | float | str] = {
        "tensor-parallel-size": plan.chosen.tp,
        "gpu-memory-utilization": plan.hardware.utilization,
        "max-num-seqs": plan.max_num_seqs,
        "max-model-len": plan.workload.max_model_len,
        "block-size": plan.workload.block_size,
    }
    if plan.weight_dtype in _TORCH_DTYPE:
        args["dtype"] = _TORCH_DTYPE[plan.weight_dtype]
    elif plan.weight_dtype == "fp8":
        args["quantization"] = "fp8"
    if plan.kv_dtype == "fp8":
        args["kv-cache-dtype"] = "fp8"
    return args


def vllm_flags(plan: Plan) -> list[str]:
    flags: list[str] = []
    for name, value in engine_args(plan).items():
        flags += [f"--{name}", str(value)]
    return flags


def vllm_command(plan: Plan) -> str:
    return " ".join(["vllm", "serve", plan.shape.name, *vllm_flags(plan)])


def _q(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid double-quoted YAML scalar


def compose_snippet(plan: Plan, image: str = DEFAULT_IMAGE) -> str:
    """One service per replica, each on its own ``tp`` GPUs and host port."""
    tp, lines = plan.chosen.tp, ["services:"]
    args = ", ".join(_q(a) for a in [plan.shape.name, *vllm_flags(plan)])
    for i in range(plan.chosen.replicas):
        devices = ", ".join(_q(str(d)) for d in range(i * tp, (i + 1) * tp))
        lines += [
            f"  vllm-{i}:",
            f"    image: {_q(image)}",
            '    entrypoint: ["vllm", "serve"]',
            f"    command: [{args}]",
            f'    ports: ["{8000 + i}:8000"]',
            "    ipc: host  # tensor-parallel workers share memory",
            "    deploy:",
            "      resources:",
            "        reservations:",
            "          devices:",
            "            - driver: nvidia",
            f"              device_ids: [{devices}]",
            "              capabilities: [gpu]",
        ]
    backends = ",".join(f"http://localhost:{8000 + i}" for i in range(plan.chosen.replicas))
    lines.append(f"# then: GATEWAY_BACKENDS={backends} llm-gateway serve")
    return "\n".join(lines)


def kubernetes_snippet(plan: Plan, image: str = DEFAULT_IMAGE) -> str:
    """A Deployment of ``replicas`` pods of ``tp`` GPUs each."""
    name = "vllm-" + "".join(c if c.isalnum() else "-" for c in plan.shape.name.lower())
    name = name.strip("-")[:50].rstrip("-")
    args = "\n".join(f"            - {_q(a)}" for a in [plan.shape.name, *vllm_flags(plan)])
    return "\n".join(
        [
            "apiVersion: apps/v1",
            "kind: Deployment",
            "metadata:",
            f"  name: {name}",
            "spec:",
            f"  replicas: {plan.chosen.replicas}",
            "  selector:",
            f"    matchLabels: {{app: {name}}}",
            "  template:",
            "    metadata:",
            f"      labels: {{app: {name}}}",
            "    spec:",
            "      containers:",
            "        - name: vllm",
            f"          image: {_q(image)}",
            '          command: ["vllm", "serve"]',
            "          args:",
            args,
            "          ports: [{containerPort: 8000}]",
            "          resources:",
            f'            limits: {{nvidia.com/gpu: "{plan.chosen.tp}"}}',
            "          volumeMounts: [{name: shm, mountPath: /dev/shm}]",
            "      volumes:",
            "        - name: shm  # tensor-parallel workers share memory",
            "          emptyDir: {medium: Memory, sizeLimit: 16Gi}",
        ]
    )


def _option_json(o: TpOption) -> dict[str, Any]:
    return {
        "tensor_parallel_size": o.tp,
        "replicas": o.replicas,
        "weights_bytes_per_card": o.weights_per_card,
        "free_kv_bytes_per_card": o.free_kv_per_card,
        "kv_blocks_per_card": o.kv.num_blocks,
        "kv_tokens_per_card": o.kv.num_tokens,
        "seqs_at_max_model_len": o.seqs_at_max_len,
        "seqs_at_avg_len": o.seqs_at_avg_len,
        "demand_per_replica": o.demand_per_replica,
        "loads": o.loads,
        "meets_demand": o.meets_demand,
    }


def to_json(plan: Plan, image: str = DEFAULT_IMAGE) -> dict[str, Any]:
    """Every figure of the plan, in bytes and counts (GiB copies for reading)."""
    s, c, wl, hw = plan.shape, plan.chosen, plan.workload, plan.hardware
    avg = wl.avg_len
    latency = None
    if c.latency is not None:
        latency = {k: getattr(c.latency, k) for k in ("ttft_s", "tpot_s", "total_s")}
    return {
        "model": {
            "name": s.name,
            "num_layers": s.num_layers,
            "hidden_size": s.hidden_size,
            "num_attention_heads": s.num_attention_heads,
            "num_kv_heads": s.num_kv_heads,
            "head_dim": s.head_dim,
            "intermediate_size": s.intermediate_size,
            "vocab_size": s.vocab_size,
            "tie_word_embeddings": s.tie_word_embeddings,
            "num_experts": s.num_experts,
            "experts_per_token": s.experts_per_token,
        },
        "dtypes": {"weights": plan.weight_dtype, "kv_cache": plan.kv_dtype},
        "hardware": {
            "card_bytes": hw.card_bytes,
            "num_cards": hw.num_cards,
            "gpu_memory_utilization": hw.utilization,
            "reserve_bytes": hw.reserve_bytes,
        },
        "parameters": {
            "total": plan.params.total,
            "active": plan.params.active,
            "embedding": plan.params.embedding,
            "lm_head": plan.params.lm_head,
            "attention": plan.params.attention,
            "mlp": plan.params.mlp,
            "router": plan.params.router,
            "norms": plan.params.norms,
        },
        "weights": {
            "total_bytes": plan.weights_total,
            "total_gib": plan.weights_total / GiB,
            "per_card_bytes": c.weights_per_card,
        },
        "kv_cache": {
            "dtype_bytes": plan.kv_bytes,
            "bytes_per_token_per_card": c.kv.bytes_per_token,
            "bytes_per_block_per_card": c.kv.bytes_per_block,
            "bytes_per_seq_at_max_model_len": blocks_for(wl.max_model_len, wl.block_size)
            * c.kv.bytes_per_block,
            "bytes_per_seq_at_avg_len": (
                blocks_for(avg, wl.block_size) * c.kv.bytes_per_block if avg else None
            ),
            "usable_bytes_per_card": usable_bytes(hw.card_bytes, hw.utilization),
            "free_bytes_per_card": c.free_kv_per_card,
            "free_gib_per_card": c.free_kv_per_card / GiB,
            "num_blocks_per_card": c.kv.num_blocks,
            "num_tokens_per_card": c.kv.num_tokens,
        },
        "capacity": {
            "tensor_parallel_size": c.tp,
            "replicas": c.replicas,
            "seqs_at_max_model_len": c.seqs_at_max_len,
            "seqs_at_avg_len": c.seqs_at_avg_len,
            "avg_len": avg,
            "demand_per_replica": c.demand_per_replica,
            "latency": latency,
            "would_preempt": plan.would_preempt,
        },
        "options": [_option_json(o) for o in plan.options],
        "engine_args": engine_args(plan),
        "vllm_command": vllm_command(plan),
        "compose": compose_snippet(plan, image),
        "kubernetes": kubernetes_snippet(plan, image),
        "notes": list(plan.notes),
    }


def _working(plan: Plan) -> Table:
    s, p, c, wl, hw = plan.shape, plan.params, plan.chosen, plan.workload, plan.hardware
    h, L, bs = s.hidden_size, s.num_layers, wl.block_size
    kvh = max(1, s.num_kv_heads // c.tp)
    t = Table(title=f"Capacity plan: {s.name}", show_lines=False)
    t.add_column("step", style="bold")
    t.add_column("working")
    t.add_column("value", justify="right")
    lm = "tied to the embedding" if s.tie_word_embeddings else f"{s.vocab_size:,} x {h:,}"
    t.add_row(
        "embedding + LM head",
        f"{s.vocab_size:,} x {h:,}; LM head {lm}",
        _billions(p.embedding + p.lm_head),
    )
    t.add_row(
        "attention",
        f"{L} layers x (2 x {h:,} x {s.num_attention_heads}x{s.head_dim} (q,o)"
        f" + 2 x {h:,} x {s.num_kv_heads}x{s.head_dim} (k,v))",
        _billions(p.attention),
    )
    if s.is_moe:
        mlp = (
            f"{L} layers x {s.num_experts} experts x 3 x {h:,} x "
            f"{s.expert_intermediate_size:,} (gate, up, down)"
        )
    else:
        mlp = f"{L} layers x 3 x {h:,} x {s.intermediate_size:,} (gate, up, down)"
    t.add_row("MLP", mlp, _billions(p.mlp))
    if p.router:
        t.add_row("router", f"{L} layers x {h:,} x {s.num_experts}", _billions(p.router))
    t.add_row("norms", f"(2 x {L} + 1) x {h:,}", f"{p.norms:,}")
    t.add_row("parameters", "sum", _billions(p.total))
    if s.is_moe:
        t.add_row(
            "active per token",
            f"top-{s.experts_per_token} of {s.num_experts} experts",
            _billions(p.active),
        )
    bits = WEIGHT_BITS[plan.weight_dtype]
    t.add_row(
        "weights",
        f"{plan.weight_dtype}: {bits} bits per weight",
        f"{_size(plan.weights_total)} ({plan.weights_total / 1e9:,.3g} GB)",
    )
    t.add_row("weights per card", f"/ TP {c.tp}", _size(c.weights_per_card))
    t.add_row(
        "KV per token per card",
        f"2 x {L} layers x {kvh} KV heads x {s.head_dim} x {plan.kv_bytes} B",
        _size(c.kv.bytes_per_token),
    )
    t.add_row("KV per block", f"x block size {bs}", _size(c.kv.bytes_per_block))
    n_max = blocks_for(wl.max_model_len, bs)
    t.add_row(
        "KV per max-len sequence",
        f"{n_max:,} blocks for {wl.max_model_len:,} tokens",
        _size(n_max * c.kv.bytes_per_block),
    )
    avg = wl.avg_len
    if avg is not None:
        n_avg = blocks_for(avg, bs)
        t.add_row(
            "KV per average sequence",
            f"{n_avg:,} blocks for {avg:,} tokens",
            _size(n_avg * c.kv.bytes_per_block),
        )
    usable = usable_bytes(hw.card_bytes, hw.utilization)
    t.add_row("usable per card", f"{_gib(hw.card_bytes)} x {hw.utilization}", _gib(usable))
    t.add_row(
        "free for KV per card",
        f"{_gib(usable)} - {_gib(c.weights_per_card)} weights - {_gib(hw.reserve_bytes)} reserve",
        _gib(c.free_kv_per_card),
    )
    t.add_row(
        "KV blocks per card",
        f"free / {_size(c.kv.bytes_per_block)}",
        f"{c.kv.num_blocks:,} ({c.kv.num_tokens:,} tokens)",
    )
    t.add_row("sequences at max len", f"{c.kv.num_blocks:,} // {n_max:,}", f"{c.seqs_at_max_len:,}")
    if avg is not None:
        t.add_row(
            "sequences at avg len",
            f"{c.kv.num_blocks:,} // {blocks_for(avg, bs):,}",
            f"{c.seqs_at_avg_len:,}",
        )
    t.add_row("replicas", f"{hw.num_cards} cards // TP {c.tp}", str(c.replicas))
    if c.demand_per_replica is not None:
        t.add_row("demand per replica", _demand_working(plan), f"{c.demand_per_replica:,}")
        verdict = (
            "fits, no preemption"
            if c.meets_demand
            else "[red]would preempt: KV cache too small[/red]"
        )
        t.add_row("verdict", f"{c.demand_per_replica:,} <= {c.capacity_per_replica:,}?", verdict)
    return t


def _demand_working(plan: Plan) -> str:
    wl, c = plan.workload, plan.chosen
    if wl.concurrency is not None:
        return f"concurrency {wl.concurrency:,} / {c.replicas} replicas"
    assert wl.request_rate is not None
    if c.latency is None:
        seconds = f"measured {wl.latency_s:g} s"
    else:
        seconds = (
            f"(TTFT {c.latency.ttft_s * 1e3:.0f} ms + {wl.avg_output_tokens} x TPOT "
            f"{c.latency.tpot_s * 1e3:.1f} ms = {c.latency.total_s:.2f} s)"
        )
    return f"Little's law: {wl.request_rate:g} req/s / {c.replicas} x {seconds}"


def _options(plan: Plan) -> Table:
    t = Table(title="Tensor-parallel sizes")
    for col in (
        "TP",
        "replicas",
        "weights/card",
        "free KV/card",
        "seqs@max",
        "seqs@avg",
        "demand/replica",
        "verdict",
    ):
        t.add_column(col, justify="right")
    for o in plan.options:
        verdict = "does not load" if not o.loads else "fits" if o.meets_demand else "would preempt"
        if o is plan.chosen:
            verdict = f"[bold green]{verdict} (chosen)[/bold green]"
        t.add_row(
            str(o.tp),
            str(o.replicas),
            _gib(o.weights_per_card),
            _gib(o.free_kv_per_card),
            f"{o.seqs_at_max_len:,}",
            "-" if o.seqs_at_avg_len is None else f"{o.seqs_at_avg_len:,}",
            "-" if o.demand_per_replica is None else f"{o.demand_per_replica:,}",
            verdict,
        )
    return t


def print_plan(plan: Plan, console: Console, image: str = DEFAULT_IMAGE) -> None:
    """The working, the TP options, the flags, the snippets and the caveats."""
    console.print(_working(plan))
    console.print(_options(plan))
    console.print("\n[bold]vLLM[/bold]", highlight=False)
    console.print(vllm_command(plan), highlight=False, soft_wrap=True)
    console.print("\n[bold]docker compose[/bold]", highlight=False)
    console.print(compose_snippet(plan, image), highlight=False, markup=False, soft_wrap=True)
    console.print("\n[bold]Kubernetes[/bold]", highlight=False)
    console.print(kubernetes_snippet(plan, image), highlight=False, markup=False, soft_wrap=True)
    console.print("\n[bold]Approximations[/bold]", highlight=False)
    for note in plan.notes:
        console.print(f"- {note}", highlight=False, markup=False)
