"""The memory arithmetic of serving a model with vLLM: pure functions of the architecture.

Everything is in bytes and counted per card: with tensor parallelism (TP) each card holds
1/TP of the weights and the keys/values of its share of the KV heads, for every token of
every running sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from tools.plan.model import ModelShape, PlanError

GiB: Final = 1024**3

# Bits per weight. int4 is 4 bits: AWQ/GPTQ group scales add ~3% that is not counted.
WEIGHT_BITS: Final[dict[str, int]] = {
    "fp32": 32,
    "fp16": 16,
    "bf16": 16,
    "fp8": 8,
    "int8": 8,
    "int4": 4,
}
KV_DTYPES: Final = ("auto", "fp16", "bf16", "fp8")
_KV_BYTES: Final[dict[str, int]] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


@dataclass(frozen=True, slots=True)
class ParamCount:
    """Parameters by kind. ``attention`` and ``mlp`` are the linear layers that quantized
    checkpoints quantize; embeddings, the LM head, norms and the router stay 16-bit."""

    embedding: int
    lm_head: int
    attention: int
    mlp: int
    router: int
    norms: int
    active: int  # parameters one token passes through (an MoE token visits top-k experts)

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.attention + self.mlp + self.router + self.norms

    @property
    def quantizable(self) -> int:
        return self.attention + self.mlp


def count_parameters(shape: ModelShape) -> ParamCount:
    """Parameters of a Llama-style decoder (gated MLP, RMSNorm, optional MoE and GQA)."""
    h, layers = shape.hidden_size, shape.num_layers
    q_width = shape.num_attention_heads * shape.head_dim
    kv_width = shape.num_kv_heads * shape.head_dim
    # q and o are h x q_width; k and v are h x kv_width (smaller under grouped-query attention)
    attention = 2 * h * q_width + 2 * h * kv_width
    if shape.attention_bias:
        attention += q_width + 2 * kv_width
    gated_mlp = 3 * h * shape.intermediate_size  # gate, up and down projections
    if shape.is_moe:
        expert = 3 * h * shape.expert_intermediate_size
        shared = 3 * h * shape.shared_expert_intermediate_size
        mlp = shape.num_experts * expert + shared
        active_mlp = shape.experts_per_token * expert + shared
        router = h * shape.num_experts + (h if shared else 0)  # Qwen2-MoE gates the shared one
    else:
        mlp = active_mlp = gated_mlp
        router = 0
    embedding = shape.vocab_size * h
    lm_head = 0 if shape.tie_word_embeddings else shape.vocab_size * h
    norms = layers * 2 * h + h  # two RMSNorms per layer, one final
    active = embedding + lm_head + layers * (attention + active_mlp) + layers * router + norms
    return ParamCount(
        embedding=embedding,
        lm_head=lm_head,
        attention=layers * attention,
        mlp=layers * mlp,
        router=layers * router,
        norms=norms,
        active=active,
    )


def weight_bytes(params: ParamCount, dtype: str) -> int:
    """Bytes of weights in ``dtype``; with 8- or 4-bit weights the non-linear parts stay at
    16 bits, as in AWQ/GPTQ/FP8 checkpoints."""
    bits = WEIGHT_BITS[dtype]
    other_bits = bits if bits >= 16 else 16
    return (params.quantizable * bits + (params.total - params.quantizable) * other_bits) // 8


def kv_dtype_bytes(kv_dtype: str, weight_dtype: str) -> int:
    """Bytes per cached key or value element. ``auto`` follows the activation dtype: 16-bit
    unless the weights are fp32 (quantized weights still compute in 16 bits)."""
    if kv_dtype == "auto":
        return 4 if weight_dtype == "fp32" else 2
    return _KV_BYTES[kv_dtype]


def valid_tp_sizes(shape: ModelShape, max_cards: int) -> list[int]:
    """TP sizes vLLM accepts: attention heads divide evenly, and KV heads either divide
    evenly or (TP above the KV head count) are replicated a whole number of times."""
    return [
        tp
        for tp in range(1, max_cards + 1)
        if shape.num_attention_heads % tp == 0
        and (shape.num_kv_heads % tp == 0 or tp % shape.num_kv_heads == 0)
    ]


def kv_heads_per_card(shape: ModelShape, tp: int) -> int:
    return max(1, shape.num_kv_heads // tp)


def kv_bytes_per_token(shape: ModelShape, kv_bytes: int, tp: int = 1) -> int:
    """2 (key and value) x layers x KV heads on this card x head dim x bytes."""
    return 2 * shape.num_layers * kv_heads_per_card(shape, tp) * shape.head_dim * kv_bytes


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks one sequence of ``tokens`` tokens occupies (the last one partly filled)."""
    return -(-tokens // block_size)


def usable_bytes(card_bytes: int, utilization: float) -> int:
    """The share of a card vLLM may use: ``--gpu-memory-utilization`` x card memory."""
    return round(card_bytes * utilization)


def free_kv_bytes(
    card_bytes: int, utilization: float, weights_per_card: int, reserve_bytes: int
) -> int:
    """vLLM's KV budget: card memory x utilization, minus weights and the runtime reserve
    (activation peak of the profiling run, CUDA context, CUDA graphs). May be negative."""
    return usable_bytes(card_bytes, utilization) - weights_per_card - reserve_bytes


@dataclass(frozen=True, slots=True)
class KvLayout:
    """The KV cache of one card at one TP size."""

    bytes_per_token: int
    bytes_per_block: int
    num_blocks: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def sequences_at(self, length: int) -> int:
        """Sequences of ``length`` tokens that fit at once."""
        return self.num_blocks // blocks_for(length, self.block_size)


def kv_layout(
    shape: ModelShape, kv_bytes: int, tp: int, free_bytes: int, block_size: int
) -> KvLayout:
    per_token = kv_bytes_per_token(shape, kv_bytes, tp)
    per_block = per_token * block_size
    return KvLayout(
        bytes_per_token=per_token,
        bytes_per_block=per_block,
        num_blocks=max(free_bytes, 0) // per_block,
        block_size=block_size,
    )


@dataclass(frozen=True, slots=True)
class VllmKvReport:
    """What vLLM reports about its KV cache at startup, for one KV cache size."""

    page_bytes_per_layer: int
    num_blocks: int  # cache_config.num_gpu_blocks, /metrics vllm:cache_config_info
    max_concurrency: float  # "Maximum concurrency for M tokens per request: X.XXx"
    num_tokens: int  # "<device> KV cache size: N tokens"

    @property
    def usable_blocks(self) -> int:
        """Blocks requests can use: the block pool holds one null block back."""
        return self.num_blocks - 1


def vllm_kv_cache_report(
    shape: ModelShape,
    kv_cache_bytes: int,
    *,
    block_size: int = 128,
    kv_bytes: int = 2,
    max_model_len: int | None = None,
    tp: int = 1,
) -> VllmKvReport:
    """The figures vLLM 0.32 (v1 engine) reports for ``kv_cache_bytes`` of KV cache space.

    Worked from vLLM's ``kv_cache_utils``: a block of one layer (a page) is ``2 x
    block_size x kv_heads x head_dim x dtype_bytes``; ``num_blocks = available //
    (layers x page)``; the concurrency is ``num_blocks / ceil(max_model_len /
    block_size)``; the logged size in tokens is ``int(concurrency x max_model_len)``. On
    the CPU backend ``kv_cache_bytes`` is ``VLLM_CPU_KVCACHE_SPACE`` GiB, the default
    block size is 128 and ``--dtype auto`` gives a bf16 (2-byte) cache for a bf16 model.
    """
    page = 2 * block_size * kv_heads_per_card(shape, tp) * shape.head_dim * kv_bytes
    num_blocks = kv_cache_bytes // (page * shape.num_layers)
    length = max_model_len or shape.max_position_embeddings or block_size
    concurrency = num_blocks / blocks_for(length, block_size)
    return VllmKvReport(
        page_bytes_per_layer=page,
        num_blocks=num_blocks,
        max_concurrency=concurrency,
        num_tokens=int(concurrency * length),
    )


@dataclass(frozen=True, slots=True)
class LatencyEstimate:
    """Roofline latency of one request: prefill bound by compute, decode by bandwidth."""

    ttft_s: float
    tpot_s: float
    total_s: float


PREFILL_MFU: Final = 0.4  # fraction of peak FLOP/s a prefill achieves
DECODE_BANDWIDTH_EFFICIENCY: Final = 0.6  # fraction of peak memory bandwidth a decode step gets


def estimate_latency(
    *,
    active_params: int,
    weights_per_card: int,
    tp: int,
    prompt_tokens: int,
    output_tokens: int,
    flops_per_card: float,
    bandwidth_per_card: float,
) -> LatencyEstimate:
    """TTFT = 2 x active params x prompt tokens / (TP x FLOP/s x MFU); TPOT = weights on a
    card / (bandwidth x efficiency), since each decode step streams every weight once.
    Ignores queueing, KV reads and batch slowdown, so it is optimistic."""
    ttft = 2 * active_params * prompt_tokens / (tp * flops_per_card * PREFILL_MFU)
    tpot = weights_per_card / (bandwidth_per_card * DECODE_BANDWIDTH_EFFICIENCY)
    return LatencyEstimate(ttft_s=ttft, tpot_s=tpot, total_s=ttft + output_tokens * tpot)


def littles_law(rate_per_s: float, latency_s: float) -> int:
    """Requests in flight L = arrival rate x time in system, rounded up."""
    return math.ceil(rate_per_s * latency_s - 1e-9)


def check_dtype(weight_dtype: str, kv_dtype: str) -> None:
    if weight_dtype not in WEIGHT_BITS:
        raise PlanError(f"unknown weight dtype {weight_dtype!r} (one of {', '.join(WEIGHT_BITS)})")
    if kv_dtype not in KV_DTYPES:
        raise PlanError(f"unknown KV cache dtype {kv_dtype!r} (one of {', '.join(KV_DTYPES)})")
