"""The pure engine: scheduling, timing, KV blocks, prefix cache, preemption, aborts."""

from __future__ import annotations

from collections import defaultdict

import pytest

from tools.sim.config import SimConfig
from tools.sim.engine import Engine, Request, TokenEvent
from tools.sim.tokens import OutputText

BASE = SimConfig(
    step_base_ms=10.0,
    prefill_us_per_token=100.0,
    decode_us_per_seq=100.0,
    attention_ns_per_token=0.0,
    max_model_len=512,
)


def req(rid: int, prompt: int | list[int], out: int, arrival: float = 0.0) -> Request:
    ids = (
        tuple(range(1000 * rid, 1000 * rid + prompt)) if isinstance(prompt, int) else tuple(prompt)
    )
    return Request(rid, ids, out, "length", OutputText(seed=rid), arrival)


def run(engine: Engine, max_steps: int = 10_000) -> dict[int, list[tuple[float, TokenEvent]]]:
    """Step until idle; each request's token events with the time they happened."""
    seen: dict[int, list[tuple[float, TokenEvent]]] = defaultdict(list)
    for _ in range(max_steps):
        if not engine.has_work():
            return seen
        result = engine.step(engine.clock)
        for ev in result.tokens:
            seen[ev.request_id].append((engine.clock, ev))
    raise AssertionError("engine did not finish")


def ttft(
    events: dict[int, list[tuple[float, TokenEvent]]], rid: int, arrival: float = 0.0
) -> float:
    return events[rid][0][0] - arrival


def test_requests_beyond_max_num_seqs_wait_in_fcfs_order() -> None:
    engine = Engine(BASE.replace(max_num_seqs=2))
    for i in range(1, 6):
        engine.add_request(req(i, 8, 4))
    engine.step(0.0)
    assert [s.req.request_id for s in engine.running] == [1, 2]
    assert [s.req.request_id for s in engine.waiting] == [3, 4, 5]
    events = run(engine)
    first_token = {rid: evs[0][0] for rid, evs in events.items()}
    assert sorted(first_token, key=first_token.__getitem__) == [1, 2, 3, 4, 5]
    assert engine.stats.request_success["length"] == 5


def test_ttft_grows_with_queue_depth() -> None:
    engine = Engine(BASE.replace(max_num_seqs=1))
    for i in range(1, 5):
        engine.add_request(req(i, 16, 8))
    events = run(engine)
    ttfts = [ttft(events, i) for i in range(1, 5)]
    assert ttfts == sorted(ttfts)
    assert ttfts[3] > 3 * ttfts[0]


def test_each_step_gives_every_running_request_one_token() -> None:
    engine = Engine(BASE)
    for i in range(1, 4):
        engine.add_request(req(i, 8, 5))
    events = run(engine)
    for rid in (1, 2, 3):
        assert [ev.index for _, ev in events[rid]] == [0, 1, 2, 3, 4]
        assert events[rid][-1][1].finish_reason == "length"
        assert all(ev.finish_reason is None for _, ev in events[rid][:-1])
    assert engine.stats.generation_tokens == 15
    assert engine.stats.prompt_tokens == 24


def test_long_prompt_is_prefilled_in_chunks_under_the_token_budget() -> None:
    engine = Engine(BASE.replace(max_num_batched_tokens=32))
    engine.add_request(req(1, 100, 2))
    budgets = []
    while engine.has_work():
        budgets.append(engine.step(engine.clock).prefill_tokens)
    assert budgets[:4] == [32, 32, 32, 4]


def test_step_duration_grows_with_prefill_tokens_and_running_sequences() -> None:
    cfg = BASE.replace(attention_ns_per_token=1000.0)
    small, big = Engine(cfg), Engine(cfg)
    small.add_request(req(1, 10, 3))
    for i in range(1, 11):
        big.add_request(req(i, 10, 3))
    first_small, first_big = small.step(0.0), big.step(0.0)
    assert first_big.duration > first_small.duration  # 100 prefill tokens vs 10
    decode_small, decode_big = small.step(small.clock), big.step(big.clock)
    assert decode_small.prefill_tokens == decode_big.prefill_tokens == 0
    assert decode_big.duration == pytest.approx(
        decode_small.duration + 9 * (100e-6 + 10 * 1e-6), rel=1e-9
    )


def test_slowdown_multiplies_step_duration() -> None:
    normal, slow = Engine(BASE), Engine(BASE)
    normal.add_request(req(1, 10, 3))
    slow.add_request(req(1, 10, 3))
    assert slow.step(0.0, slowdown=3.0).duration == pytest.approx(3 * normal.step(0.0).duration)


def test_kv_blocks_are_allocated_as_sequences_grow_and_freed_at_the_end() -> None:
    engine = Engine(BASE.replace(block_size=4, enable_prefix_caching=False))
    engine.add_request(req(1, 8, 6))
    engine.step(0.0)
    assert engine.pool.num_blocks - engine.pool.num_free == 2  # 8 prompt tokens
    for _ in range(2):
        engine.step(engine.clock)
    assert engine.pool.num_blocks - engine.pool.num_free == 3  # 10 tokens computed
    run(engine)
    assert engine.pool.usage == 0.0


def test_prefix_cache_hits_skip_prefill_and_cut_ttft() -> None:
    engine = Engine(BASE.replace(max_num_batched_tokens=64))
    prompt = list(range(500))
    engine.add_request(req(1, prompt, 2))
    cold = run(engine)
    start = engine.clock
    engine.add_request(req(2, prompt, 2, arrival=start))
    warm = run(engine)
    assert engine.stats.prefix_cache_queries == 1000
    assert engine.stats.prefix_cache_hits == 496  # 31 full blocks; the last token is computed
    assert ttft(warm, 2, start) < ttft(cold, 1) / 4


def test_prefix_cache_stops_at_the_first_differing_block() -> None:
    engine = Engine(BASE)
    engine.add_request(req(1, list(range(64)), 1))
    run(engine)
    engine.add_request(req(2, [*range(40), *range(900, 924)], 1, arrival=engine.clock))
    run(engine)
    assert engine.stats.prefix_cache_hits == 32  # blocks 0 and 1; block 2 differs


def test_cached_blocks_are_evicted_least_recently_used_first() -> None:
    engine = Engine(BASE.replace(num_gpu_blocks_override=40, block_size=16))
    engine.add_request(req(1, list(range(320)), 1))  # 20 blocks
    run(engine)
    engine.add_request(req(2, list(range(10_000, 10_320)), 1, arrival=engine.clock))
    run(engine)
    engine.add_request(req(3, list(range(20_000, 20_320)), 1, arrival=engine.clock))
    run(engine)  # needs 20 more blocks: request 1's, the least recently used, go
    hits = engine.stats.prefix_cache_hits
    engine.add_request(req(4, list(range(10_000, 10_320)), 1, arrival=engine.clock))
    run(engine)
    assert engine.stats.prefix_cache_hits - hits == 304  # request 2's blocks survived
    engine.add_request(req(5, list(range(320)), 1, arrival=engine.clock))
    hits = engine.stats.prefix_cache_hits
    run(engine)
    assert engine.stats.prefix_cache_hits == hits  # request 1's were evicted


def test_newest_running_request_is_preempted_when_kv_blocks_run_out() -> None:
    cfg = BASE.replace(block_size=4, num_gpu_blocks_override=8, max_model_len=32)
    engine = Engine(cfg)
    engine.add_request(req(1, 8, 20))
    engine.add_request(req(2, 8, 20))
    preempted: list[int] = []
    events: dict[int, list[int]] = defaultdict(list)
    while engine.has_work():
        result = engine.step(engine.clock)
        preempted += result.preempted
        for ev in result.tokens:
            events[ev.request_id].append(ev.index)
    assert engine.stats.num_preemptions == len(preempted) >= 1
    assert preempted[0] == 2
    # The preempted request resumes where it stopped: no token twice, none missing.
    assert events[1] == list(range(20))
    assert events[2] == list(range(20))
    assert engine.pool.usage == 0.0


def test_preempted_request_goes_back_to_the_front_of_the_queue() -> None:
    cfg = BASE.replace(block_size=4, num_gpu_blocks_override=8, max_model_len=32)
    engine = Engine(cfg)
    for i in (1, 2, 3):
        engine.add_request(req(i, 12, 20))  # 3 blocks each: the third waits for room
    engine.step(0.0)
    assert [s.req.request_id for s in engine.waiting] == [3]
    while not engine.stats.num_preemptions:
        engine.step(engine.clock)
    assert [s.req.request_id for s in engine.waiting] == [2, 3]


def test_abort_while_queued_removes_the_request() -> None:
    engine = Engine(BASE.replace(max_num_seqs=1))
    engine.add_request(req(1, 8, 50))
    engine.add_request(req(2, 8, 50))
    engine.step(0.0)
    assert engine.abort(2) == "queued"
    assert not engine.waiting
    assert engine.stats.aborted == {"queued": 1, "transfer": 0, "prefill": 0, "decode": 0}


def test_abort_in_prefill_frees_its_blocks() -> None:
    engine = Engine(BASE.replace(max_num_batched_tokens=16))
    engine.add_request(req(1, 200, 5))
    engine.step(0.0)
    assert engine.phase_of(1) == "prefill"
    assert engine.pool.usage > 0
    assert engine.abort(1) == "prefill"
    assert engine.pool.usage == 0.0
    assert not engine.has_work()
    assert engine.stats.aborted["prefill"] == 1


def test_abort_in_decode_stops_generation_and_is_not_a_success() -> None:
    engine = Engine(BASE)
    engine.add_request(req(1, 8, 100))
    for _ in range(5):
        engine.step(engine.clock)
    assert engine.phase_of(1) == "decode"
    assert engine.abort(1) == "decode"
    assert engine.abort(1) is None  # already gone
    assert not engine.has_work()
    assert engine.stats.generation_tokens == 5
    assert engine.pool.usage == 0.0
    assert engine.stats.aborted["decode"] == 1
    assert sum(engine.stats.request_success.values()) == 0


def test_latency_histograms_are_observed() -> None:
    engine = Engine(BASE.replace(max_num_seqs=1))
    engine.add_request(req(1, 8, 3))
    engine.add_request(req(2, 8, 3))
    run(engine)
    stats = engine.stats
    assert stats.ttft.count == 2
    assert stats.itl.count == 4
    assert stats.e2e.count == stats.queue_time.count == 2
    assert stats.queue_time.sum > 0  # the second request waited for the first
    assert stats.e2e.sum > stats.ttft.sum


def test_invalid_requests_are_rejected() -> None:
    engine = Engine(BASE)
    engine.add_request(req(1, 8, 1))
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request(req(1, 8, 1))
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request(req(2, 0, 1))
