"""The arithmetic against cases worked by hand (the working is in the comments).

Conventions: GiB = 2**30 bytes; an 80 GiB card at --gpu-memory-utilization 0.9 leaves
0.9 x 85,899,345,920 = 77,309,411,328 bytes usable; the default reserve is 2 GiB =
2,147,483,648 bytes.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.tools.plan.configs import LLAMA2_7B, LLAMA2_70B, MIXTRAL_8X7B, tiny_llama
from tools.plan.arithmetic import (
    GiB,
    count_parameters,
    kv_bytes_per_token,
    kv_heads_per_card,
    valid_tp_sizes,
    vllm_kv_cache_report,
    weight_bytes,
)
from tools.plan.model import ModelShape, PlanError, shape_from_config
from tools.plan.planner import Hardware, Workload, make_plan

CARD_80 = 80 * GiB
USABLE_80 = 77_309_411_328
RESERVE = 2 * GiB


def shape(raw: dict[str, Any], name: str = "m") -> ModelShape:
    return shape_from_config(raw, name=name)


# ---------------------------------------------------------------- Llama-2-7B (MHA)


def test_llama2_7b_parameters_and_fp16_weights() -> None:
    p = count_parameters(shape(LLAMA2_7B))
    # embedding 32,000 x 4,096 = 131,072,000; untied LM head the same again
    assert p.embedding == p.lm_head == 131_072_000
    # attention per layer: q, k, v, o all 4,096 x 4,096 (32 KV heads = 32 heads) = 67,108,864
    assert p.attention == 32 * 67_108_864
    # MLP per layer: 3 x 4,096 x 11,008 = 135,266,304
    assert p.mlp == 32 * 135_266_304
    # norms: (2 x 32 + 1) x 4,096 = 266,240
    assert p.norms == 266_240
    # 32 x (67,108,864 + 135,266,304) + 262,144,000 + 266,240 = 6,738,415,616 (the
    # published Llama-2-7B count)
    assert p.total == p.active == 6_738_415_616
    # fp16: 2 bytes each = 13,476,831,232 B (12.55 GiB)
    assert weight_bytes(p, "fp16") == 13_476_831_232
    assert weight_bytes(p, "fp32") == 26_953_662_464


def test_llama2_7b_kv_cache_and_capacity_on_one_80gib_card() -> None:
    s = shape(LLAMA2_7B)
    # per token: 2 (k, v) x 32 layers x 32 KV heads x 128 head dim x 2 B = 524,288 B (512 KiB)
    assert kv_bytes_per_token(s, 2) == 524_288
    plan = make_plan(
        s,
        weight_dtype="fp16",
        kv_dtype="auto",
        hardware=Hardware(card_bytes=CARD_80),
        workload=Workload(max_model_len=4096, avg_prompt_tokens=1000, avg_output_tokens=300),
    )
    c = plan.chosen
    assert plan.kv_bytes == 2  # auto with 16-bit weights
    # per block: 524,288 x 16 = 8,388,608 B (8 MiB)
    assert c.kv.bytes_per_block == 8_388_608
    # free: 77,309,411,328 - 13,476,831,232 weights - 2,147,483,648 reserve = 61,685,096,448
    assert c.free_kv_per_card == 61_685_096_448
    # blocks: 61,685,096,448 // 8,388,608 = 7,353 (7,353 x 8,388,608 = 61,681,434,624);
    # tokens: 7,353 x 16 = 117,648
    assert (c.kv.num_blocks, c.kv.num_tokens) == (7_353, 117_648)
    # a 4,096-token sequence takes 4,096 / 16 = 256 blocks: 7,353 // 256 = 28 sequences
    assert c.seqs_at_max_len == 28
    # average 1,000 + 300 = 1,300 tokens -> ceil(1,300 / 16) = 82 blocks: 7,353 // 82 = 89
    assert c.seqs_at_avg_len == 89
    assert (c.tp, c.replicas, plan.max_num_seqs) == (1, 1, 89)


@pytest.mark.parametrize(("concurrency", "preempts"), [(89, False), (90, True)])
def test_llama2_7b_concurrency_beyond_the_cache_would_preempt(
    concurrency: int, preempts: bool
) -> None:
    # capacity at 1,300 tokens is 89 sequences (previous test)
    plan = make_plan(
        shape(LLAMA2_7B),
        weight_dtype="fp16",
        kv_dtype="auto",
        hardware=Hardware(card_bytes=CARD_80),
        workload=Workload(
            max_model_len=4096,
            avg_prompt_tokens=1000,
            avg_output_tokens=300,
            concurrency=concurrency,
        ),
    )
    assert plan.would_preempt is preempts
    assert plan.chosen.demand_per_replica == concurrency


def test_llama2_7b_request_rate_uses_littles_law_with_the_roofline_latency() -> None:
    plan = make_plan(
        shape(LLAMA2_7B),
        weight_dtype="fp16",
        kv_dtype="auto",
        hardware=Hardware(card_bytes=CARD_80, bandwidth_bytes_per_s=2.0e12, flops=312e12),
        workload=Workload(
            max_model_len=4096, avg_prompt_tokens=1000, avg_output_tokens=300, request_rate=10
        ),
    )
    lat = plan.chosen.latency
    assert lat is not None
    # TTFT = 2 x 6,738,415,616 x 1,000 / (1 x 312e12 x 0.4) = 1.3477e13 / 1.248e14 = 0.10799 s
    assert lat.ttft_s == pytest.approx(0.107987, rel=1e-5)
    # TPOT = 13,476,831,232 B / (2e12 B/s x 0.6) = 0.011231 s
    assert lat.tpot_s == pytest.approx(0.0112307, rel=1e-5)
    # W = 0.10799 + 300 x 0.011231 = 3.4772 s; L = 10 req/s x 3.4772 s = 34.8 -> 35 in flight
    assert lat.total_s == pytest.approx(3.47720, rel=1e-5)
    assert plan.chosen.demand_per_replica == 35
    assert not plan.would_preempt  # 35 <= 89


def test_measured_latency_replaces_the_estimate() -> None:
    plan = make_plan(
        shape(LLAMA2_7B),
        weight_dtype="fp16",
        kv_dtype="auto",
        hardware=Hardware(card_bytes=CARD_80),
        workload=Workload(max_model_len=4096, request_rate=4, latency_s=30),
    )
    # L = 4 req/s x 30 s = 120 in flight, more than the 28 max-length sequences that fit
    assert plan.chosen.latency is None
    assert plan.chosen.demand_per_replica == 120
    assert plan.would_preempt


# ---------------------------------------------------------- Llama-2-70B (GQA, 8 KV heads)


def test_llama2_70b_parameters_and_fp16_weights() -> None:
    p = count_parameters(shape(LLAMA2_70B))
    # attention per layer: q and o 8,192 x 8,192 = 67,108,864 each; k and v
    # 8,192 x (8 KV heads x 128) = 8,388,608 each -> 150,994,944
    assert p.attention == 80 * 150_994_944
    # MLP per layer: 3 x 8,192 x 28,672 = 704,643,072
    assert p.mlp == 80 * 704_643_072
    # 80 x 855,654,400 (incl. 16,384 of norms) + 2 x 262,144,000 + 8,192 = 68,976,648,192
    assert p.total == 68_976_648_192
    # fp16: 137,953,296,384 B, the "about 140 GB" of the issue (128.48 GiB)
    assert weight_bytes(p, "fp16") == 137_953_296_384


def test_llama2_70b_kv_heads_are_split_then_replicated_by_tp() -> None:
    s = shape(LLAMA2_70B)
    # 2 x 80 layers x 8 KV heads x 128 x 2 B = 327,680 B per token on one card
    assert kv_bytes_per_token(s, 2, tp=1) == 327_680
    # TP 4: 2 KV heads per card -> 81,920 B; TP 8: 1 -> 40,960 B
    assert kv_bytes_per_token(s, 2, tp=4) == 81_920
    assert kv_bytes_per_token(s, 2, tp=8) == 40_960
    # TP 16 > 8 KV heads: each head is replicated on 2 cards, still 1 per card
    assert kv_heads_per_card(s, 16) == 1
    # 64 heads and 8 KV heads: TP must divide 64 and divide or be divided by 8
    assert valid_tp_sizes(s, 16) == [1, 2, 4, 8, 16]


def test_llama2_70b_smallest_tp_whose_replicas_hold_the_demand_on_8_cards() -> None:
    plan = make_plan(
        shape(LLAMA2_70B),
        weight_dtype="fp16",
        kv_dtype="auto",
        hardware=Hardware(card_bytes=CARD_80, num_cards=8),
        workload=Workload(
            max_model_len=4096, avg_prompt_tokens=1000, avg_output_tokens=300, concurrency=200
        ),
    )
    by_tp = {o.tp: o for o in plan.options}
    # TP 1: 137,953,296,384 B of weights > 77,309,411,328 usable: does not load
    assert not by_tp[1].loads
    # TP 2 (4 replicas): weights 68,976,648,192 per card; free 77,309,411,328 - 68,976,648,192
    # - 2,147,483,648 = 6,185,279,488; block 2 x 80 x 4 x 128 x 2 x 16 = 2,621,440 B;
    # 6,185,279,488 // 2,621,440 = 2,359 blocks; 2,359 // 82 = 28 sequences < 200 / 4 = 50
    o2 = by_tp[2]
    assert (o2.free_kv_per_card, o2.kv.num_blocks, o2.seqs_at_avg_len) == (6_185_279_488, 2_359, 28)
    assert o2.demand_per_replica == 50
    assert not o2.meets_demand
    # TP 4 (2 replicas): weights 34,488,324,096; free 77,309,411,328 - 34,488,324,096
    # - 2,147,483,648 = 40,673,603,584; block 81,920 x 16 = 1,310,720 B;
    # 40,673,603,584 // 1,310,720 = 31,031 blocks; 31,031 // 82 = 378 >= 200 / 2 = 100
    o4 = by_tp[4]
    assert (o4.free_kv_per_card, o4.kv.num_blocks) == (40_673_603_584, 31_031)
    assert (o4.seqs_at_max_len, o4.seqs_at_avg_len) == (121, 378)  # 31,031 // 256 = 121
    assert plan.chosen is o4
    assert (plan.max_num_seqs, plan.would_preempt) == (378, False)


def test_llama2_70b_cannot_fit_on_one_card() -> None:
    with pytest.raises(PlanError, match=r"cannot fit on 1 card.*128\.5 GiB of weights"):
        make_plan(
            shape(LLAMA2_70B, "llama-70b"),
            weight_dtype="fp16",
            kv_dtype="auto",
            hardware=Hardware(card_bytes=CARD_80),
            workload=Workload(max_model_len=4096),
        )


# ------------------------------------------------------------------ Mixtral-8x7B (MoE)


def test_mixtral_parameters_count_every_expert_and_active_counts_top_2() -> None:
    p = count_parameters(shape(MIXTRAL_8X7B))
    # attention per layer: q, o 4,096 x 4,096 = 16,777,216 each; k, v 4,096 x 1,024 =
    # 4,194,304 each -> 41,943,040
    assert p.attention == 32 * 41_943_040
    # one expert: 3 x 4,096 x 14,336 = 176,160,768; 8 experts = 1,409,286,144 per layer
    assert p.mlp == 32 * 1_409_286_144
    # router: 4,096 x 8 = 32,768 per layer
    assert p.router == 32 * 32_768
    # 32 x (41,943,040 + 1,409,286,144 + 32,768 + 8,192 norms) + 262,144,000 + 4,096
    # = 46,702,792,704 (the published 46.7 B)
    assert p.total == 46_702_792_704
    # active: 2 experts instead of 8 -> 32 x 394,305,536 + 262,148,096 = 12,879,925,248
    assert p.active == 12_879_925_248
    assert weight_bytes(p, "bf16") == 93_405_585_408


def test_mixtral_int4_keeps_embeddings_and_router_at_16_bits() -> None:
    p = count_parameters(shape(MIXTRAL_8X7B))
    # quantized: attention + experts = 1,342,177,280 + 45,097,156,608 = 46,439,333,888 at
    # 0.5 B = 23,219,666,944; the rest (embedding, LM head, router, norms) 263,458,816 at
    # 2 B = 526,917,632; total 23,746,584,576
    assert weight_bytes(p, "int4") == 23_746_584_576


def test_mixtral_bf16_on_two_cards_at_tp_2() -> None:
    plan = make_plan(
        shape(MIXTRAL_8X7B),
        weight_dtype="bf16",
        kv_dtype="auto",
        hardware=Hardware(card_bytes=CARD_80, num_cards=2),
        workload=Workload(max_model_len=32768),
    )
    c = plan.chosen
    # TP 1 needs 93,405,585,408 B of weights on one card: too much; TP 2 loads
    assert not plan.options[0].loads
    assert c.tp == 2
    # per card: 46,702,792,704 B of weights; free 77,309,411,328 - 46,702,792,704
    # - 2,147,483,648 = 28,459,134,976
    assert c.free_kv_per_card == 28_459_134_976
    # KV per token per card: 2 x 32 x (8 / 2 = 4) x 128 x 2 B = 65,536; block 1,048,576 B;
    # 28,459,134,976 // 1,048,576 = 27,140 blocks; 32,768-token sequence = 2,048 blocks: 13
    assert (c.kv.bytes_per_token, c.kv.num_blocks, c.seqs_at_max_len) == (65_536, 27_140, 13)
    assert plan.max_num_seqs == 13


def test_mixtral_int4_with_fp8_kv_cache_fits_one_card() -> None:
    plan = make_plan(
        shape(MIXTRAL_8X7B),
        weight_dtype="int4",
        kv_dtype="fp8",
        hardware=Hardware(card_bytes=CARD_80),
        workload=Workload(max_model_len=32768),
    )
    c = plan.chosen
    # free: 77,309,411,328 - 23,746,584,576 - 2,147,483,648 = 51,415,343,104
    # KV per token: 2 x 32 x 8 x 128 x 1 B = 65,536; per block 1,048,576;
    # 51,415,343,104 // 1,048,576 = 49,033 blocks; 49,033 // 2,048 = 23 sequences
    assert c.free_kv_per_card == 51_415_343_104
    assert (c.kv.bytes_per_token, c.kv.num_blocks, c.seqs_at_max_len) == (65_536, 49_033, 23)


# ------------------------------------------- the end-to-end tests' tiny model, and vLLM


def test_tiny_model_parameters_match_what_the_build_script_reports() -> None:
    p = count_parameters(shape(tiny_llama()))
    # embedding 512 x 128 = 65,536, tied (no LM head); attention per layer: q, o 128 x 128 =
    # 16,384 each, k, v 128 x 64 = 8,192 each -> 49,152; MLP 3 x 128 x 256 = 98,304;
    # norms (2 x 2 + 1) x 128 = 640. 2 x (49,152 + 98,304) + 65,536 + 640 = 361,088, the
    # count build_tiny_model.py records in build-info.json.
    assert (p.embedding, p.lm_head) == (65_536, 0)
    assert p.total == 361_088


def test_tiny_model_vllm_cpu_report_for_one_gib_of_kv_cache() -> None:
    s = shape(tiny_llama())
    # VLLM_CPU_KVCACHE_SPACE=1 -> 1,073,741,824 B; CPU block size 128; bf16 KV (2 B).
    # page per layer: 2 x 128 x 1 KV head x 64 x 2 B = 32,768 B;
    # blocks: 1,073,741,824 // (2 layers x 32,768 = 65,536 B per block) = 16,384;
    # concurrency at 16,384 tokens: 16,384 / (16,384 / 128 = 128 blocks) = 128.00x;
    # logged size: int(128.0 x 16,384) = 2,097,152 tokens (= 16,384 blocks x 128 here, as
    # 16,384 is a whole number of blocks); requests can use 16,383 (one null block)
    report = vllm_kv_cache_report(s, GiB, block_size=128, kv_bytes=2, max_model_len=16384)
    assert report.page_bytes_per_layer == 32_768
    assert (report.num_blocks, report.usable_blocks) == (16_384, 16_383)
    assert report.max_concurrency == 128.0
    assert report.num_tokens == 2_097_152
    # the same figures through the planner's own formula: 512 B per token, 65,536 per block
    assert kv_bytes_per_token(s, 2) * 128 * report.num_blocks == GiB


def test_vllm_report_with_a_remainder_and_fp32_kv() -> None:
    s = shape(tiny_llama())
    # 1,000,000 B at fp32, block 16: page 2 x 16 x 1 x 64 x 4 = 8,192 B; per block over
    # 2 layers 16,384 B; 1,000,000 // 16,384 = 61 blocks (976 token slots);
    # concurrency at 100 tokens: 61 / ceil(100 / 16) = 61 / 7 = 8.714x;
    # logged size: int(8.714 x 100) = 871 tokens, not 976: vLLM counts whole requests' blocks
    report = vllm_kv_cache_report(s, 1_000_000, block_size=16, kv_bytes=4, max_model_len=100)
    assert report.num_blocks == 61
    assert report.max_concurrency == pytest.approx(8.714, abs=1e-3)
    assert report.num_tokens == 871
