"""From a model, cards and a workload to a plan: the TP size, the capacity, the engine
arguments. Pure; every figure a step of the working needs is kept in the result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from tools.plan.arithmetic import (
    GiB,
    KvLayout,
    LatencyEstimate,
    ParamCount,
    blocks_for,
    check_dtype,
    count_parameters,
    estimate_latency,
    free_kv_bytes,
    kv_dtype_bytes,
    kv_layout,
    littles_law,
    usable_bytes,
    valid_tp_sizes,
    weight_bytes,
)
from tools.plan.model import ModelShape, PlanError

MAX_NUM_SEQS_CAP: Final = 1024  # past this, bigger batches rarely add throughput


_QUANT_NOTES: Final[dict[str, str]] = {
    "int4": "int4 weights: attention and MLP at 4 bits, embeddings, LM head and norms at 16; "
    "group-wise scales (~3% more) are not counted.",
    "int8": "int8 weights: attention and MLP at 8 bits, embeddings, LM head and norms at 16; "
    "per-channel scales are not counted.",
    "fp8": "fp8 weights: attention and MLP at 8 bits, embeddings, LM head and norms at 16.",
}


@dataclass(frozen=True, slots=True)
class Hardware:
    card_bytes: int
    num_cards: int = 1
    utilization: float = 0.90
    reserve_bytes: int = 2 * GiB
    bandwidth_bytes_per_s: float = 2.0e12  # A100-80GB: ~2 TB/s HBM
    flops: float = 312e12  # A100: 312 dense bf16 TFLOP/s


@dataclass(frozen=True, slots=True)
class Workload:
    max_model_len: int
    block_size: int = 16
    avg_prompt_tokens: int | None = None
    avg_output_tokens: int | None = None
    concurrency: int | None = None  # requests in flight, across all replicas
    request_rate: float | None = None  # requests per second, across all replicas
    latency_s: float | None = None  # measured time per request, instead of the estimate

    @property
    def avg_len(self) -> int | None:
        if self.avg_prompt_tokens is None or self.avg_output_tokens is None:
            return None
        return self.avg_prompt_tokens + self.avg_output_tokens


@dataclass(frozen=True, slots=True)
class TpOption:
    """The figures at one tensor-parallel size."""

    tp: int
    replicas: int
    weights_per_card: int
    free_kv_per_card: int
    kv: KvLayout
    seqs_at_max_len: int
    seqs_at_avg_len: int | None
    latency: LatencyEstimate | None
    demand_per_replica: int | None  # requests in flight each replica must hold

    @property
    def loads(self) -> bool:
        """vLLM starts: weights fit and the cache holds one max_model_len sequence."""
        return self.seqs_at_max_len >= 1

    @property
    def capacity_per_replica(self) -> int:
        return self.seqs_at_avg_len if self.seqs_at_avg_len is not None else self.seqs_at_max_len

    @property
    def meets_demand(self) -> bool:
        return self.demand_per_replica is None or (
            self.loads and self.demand_per_replica <= self.capacity_per_replica
        )


@dataclass(frozen=True, slots=True)
class Plan:
    shape: ModelShape
    weight_dtype: str
    kv_dtype: str
    kv_bytes: int
    hardware: Hardware
    workload: Workload
    params: ParamCount
    weights_total: int
    options: tuple[TpOption, ...]
    chosen: TpOption
    max_num_seqs: int
    notes: tuple[str, ...] = field(default=())

    @property
    def would_preempt(self) -> bool:
        return not self.chosen.meets_demand


def _option(
    *,
    shape: ModelShape,
    params: ParamCount,
    weights_total: int,
    kv_bytes: int,
    hw: Hardware,
    wl: Workload,
    tp: int,
) -> TpOption:
    replicas = hw.num_cards // tp
    # Column/row-parallel linears and the vocab-parallel embedding split evenly across
    # ranks; the norms (tiny) are replicated, which this ignores.
    per_card = -(-weights_total // tp)
    free = free_kv_bytes(hw.card_bytes, hw.utilization, per_card, hw.reserve_bytes)
    kv = kv_layout(shape, kv_bytes, tp, free, wl.block_size)
    avg = wl.avg_len
    latency = None
    demand = None
    if wl.concurrency is not None:
        demand = -(-wl.concurrency // replicas)
    elif wl.request_rate is not None:
        if wl.latency_s is not None:
            seconds = wl.latency_s
        else:
            assert wl.avg_prompt_tokens is not None
            assert wl.avg_output_tokens is not None
            latency = estimate_latency(
                active_params=params.active,
                weights_per_card=per_card,
                tp=tp,
                prompt_tokens=wl.avg_prompt_tokens,
                output_tokens=wl.avg_output_tokens,
                flops_per_card=hw.flops,
                bandwidth_per_card=hw.bandwidth_bytes_per_s,
            )
            seconds = latency.total_s
        demand = littles_law(wl.request_rate / replicas, seconds)
    return TpOption(
        tp=tp,
        replicas=replicas,
        weights_per_card=per_card,
        free_kv_per_card=free,
        kv=kv,
        seqs_at_max_len=kv.sequences_at(wl.max_model_len),
        seqs_at_avg_len=kv.sequences_at(avg) if avg is not None else None,
        latency=latency,
        demand_per_replica=demand,
    )


def _validate(
    shape: ModelShape, weight_dtype: str, kv_dtype: str, hw: Hardware, wl: Workload
) -> None:
    check_dtype(weight_dtype, kv_dtype)
    if hw.card_bytes <= 0 or hw.num_cards < 1:
        raise PlanError("card memory and the number of cards must be positive")
    if not 0 < hw.utilization <= 1:
        raise PlanError(f"gpu memory utilization must be in (0, 1], got {hw.utilization}")
    if hw.reserve_bytes < 0:
        raise PlanError("the runtime reserve cannot be negative")
    if wl.max_model_len < 1 or wl.block_size < 1:
        raise PlanError("max model len and block size must be positive")
    limit = shape.max_position_embeddings
    if limit is not None and wl.max_model_len > limit:
        raise PlanError(
            f"max model len {wl.max_model_len} exceeds the model's max_position_embeddings "
            f"({limit}); vLLM refuses it"
        )
    if (wl.avg_prompt_tokens is None) != (wl.avg_output_tokens is None):
        raise PlanError("give both --avg-prompt-tokens and --avg-output-tokens, or neither")
    avg = wl.avg_len
    if avg is not None and not 1 <= avg <= wl.max_model_len:
        raise PlanError(f"average prompt + output ({avg}) must be between 1 and max model len")
    if wl.concurrency is not None and wl.request_rate is not None:
        raise PlanError("give --concurrency or --request-rate, not both")
    if wl.concurrency is not None and wl.concurrency < 1:
        raise PlanError("concurrency must be at least 1")
    if wl.request_rate is not None:
        if wl.request_rate <= 0:
            raise PlanError("request rate must be positive")
        if wl.latency_s is None and avg is None:
            raise PlanError(
                "--request-rate needs --avg-prompt-tokens and --avg-output-tokens (to "
                "estimate the latency) or a measured --latency-s"
            )


def _not_fitting(shape: ModelShape, hw: Hardware, wl: Workload, best: TpOption) -> PlanError:
    usable = usable_bytes(hw.card_bytes, hw.utilization)
    gib = f"{best.weights_per_card / GiB:.1f} GiB of weights + {hw.reserve_bytes / GiB:.1f} GiB"
    if best.free_kv_per_card <= 0:
        why = f"{gib} reserve per card exceeds the usable {usable / GiB:.1f} GiB"
    else:
        need = blocks_for(wl.max_model_len, wl.block_size) * best.kv.bytes_per_block
        why = (
            f"after {gib} reserve, {best.free_kv_per_card / GiB:.2f} GiB is left for the KV "
            f"cache but one {wl.max_model_len}-token sequence needs {need / GiB:.2f} GiB"
        )
    return PlanError(
        f"{shape.name} cannot fit on {hw.num_cards} card(s) of {hw.card_bytes / GiB:g} GiB "
        f"even at tensor-parallel size {best.tp}: {why}. Use more or larger cards, a smaller "
        "weight or KV dtype, or a shorter --max-model-len."
    )


def make_plan(
    shape: ModelShape,
    *,
    weight_dtype: str,
    kv_dtype: str,
    hardware: Hardware,
    workload: Workload,
    tp: int | None = None,
) -> Plan:
    """Evaluate every valid TP size up to the number of cards and choose the smallest one
    whose replicas hold the demand (or, without a demand, that loads). Raises PlanError."""
    _validate(shape, weight_dtype, kv_dtype, hardware, workload)
    params = count_parameters(shape)
    total = weight_bytes(params, weight_dtype)
    kv_bytes = kv_dtype_bytes(kv_dtype, weight_dtype)
    sizes = valid_tp_sizes(shape, hardware.num_cards)
    if tp is not None:
        if tp not in sizes:
            raise PlanError(
                f"tensor-parallel size {tp} is not usable with {hardware.num_cards} card(s), "
                f"{shape.num_attention_heads} attention heads and {shape.num_kv_heads} KV "
                f"heads; usable sizes: {', '.join(map(str, sizes)) or 'none'}"
            )
        sizes = [tp]
    options = tuple(
        _option(
            shape=shape,
            params=params,
            weights_total=total,
            kv_bytes=kv_bytes,
            hw=hardware,
            wl=workload,
            tp=s,
        )
        for s in sizes
    )
    loading = [o for o in options if o.loads]
    if not loading:
        raise _not_fitting(shape, hardware, workload, options[-1])
    meeting = [o for o in loading if o.meets_demand]
    chosen = (
        meeting[0] if meeting else max(loading, key=lambda o: o.replicas * o.capacity_per_replica)
    )
    max_num_seqs = max(1, min(chosen.capacity_per_replica, MAX_NUM_SEQS_CAP))
    return Plan(
        shape=shape,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        kv_bytes=kv_bytes,
        hardware=hardware,
        workload=workload,
        params=params,
        weights_total=total,
        options=options,
        chosen=chosen,
        max_num_seqs=max_num_seqs,
        notes=_notes(shape, weight_dtype, workload, chosen, max_num_seqs),
    )


def _notes(
    shape: ModelShape, weight_dtype: str, wl: Workload, chosen: TpOption, max_num_seqs: int
) -> tuple[str, ...]:
    notes = [
        "Runtime reserve is an estimate: vLLM measures it at startup (activation peak of a "
        "profiling forward pass at max-num-batched-tokens, CUDA context, NCCL buffers, CUDA "
        "graphs). Check 'Available KV cache memory' in vLLM's startup log.",
        "Capacity counts whole KV blocks per sequence and ignores prefix-cache sharing "
        "(which only adds capacity) and vLLM's one reserved null block.",
    ]
    if weight_dtype in _QUANT_NOTES:
        notes.append(_QUANT_NOTES[weight_dtype])
    if shape.is_moe:
        notes.append(
            "MoE: every expert is resident on every card (sharded by TP), though a token "
            "only passes through the top-k; expert parallelism is not modelled."
        )
    if shape.sliding_window is not None:
        notes.append(
            f"The config has a {shape.sliding_window}-token sliding window; this plan "
            "counts full-length KV for every layer, an upper bound."
        )
    if chosen.latency is not None:
        notes.append(
            "Latency is a roofline estimate (prefill at 40% of peak FLOP/s, decode at 60% "
            "of peak bandwidth, no queueing or batch slowdown), so the in-flight demand from "
            "Little's law is a lower bound; pass a measured --latency-s to replace it."
        )
    if wl.avg_len is not None and max_num_seqs > chosen.seqs_at_max_len:
        notes.append(
            f"--max-num-seqs {max_num_seqs} assumes average-length requests; only "
            f"{chosen.seqs_at_max_len} sequences at the full max-model-len fit, so many long "
            "requests at once would still preempt."
        )
    return tuple(notes)
