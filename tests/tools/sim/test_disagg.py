"""Disaggregated prefill in the simulator: a prefill instance (kv_producer) hands its KV over
with ``kv_transfer_params``; a decode instance (kv_consumer) given them skips the prefill and
pays a transfer time per prompt token instead."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tools.sim import FAST, running_sim
from tools.sim.cli import config_from_args
from tools.sim.config import SimConfig
from tools.sim.engine import Engine, Request

from .conftest import completion_body, sse_events
from .test_cli import parse
from .test_engine import BASE, req, run

PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
TRANSFER = BASE.replace(kv_role="kv_both", kv_transfer_us_per_token=1000.0)  # 1 ms a token


def remote(rid: int, prompt: int, out: int, *, prefill: bool) -> Request:
    r = req(rid, prompt, out)
    return Request(
        r.request_id,
        r.prompt_ids,
        r.output_len,
        r.finish_reason,
        r.output,
        r.arrival,
        remote_decode=not prefill,
        remote_prefill=prefill,
    )


def test_prefill_only_request_reports_the_blocks_it_filled() -> None:
    engine = Engine(TRANSFER)
    engine.add_request(remote(1, 40, 1, prefill=False))
    [(_, last)] = run(engine)[1]
    assert last.finish_reason == "length"
    assert len(last.block_ids) == 3  # 40 prompt tokens + 1 sampled, 16 to a block
    assert engine.pool.num_free == TRANSFER.num_gpu_blocks_override  # freed at once


def test_remote_prefill_waits_for_the_transfer_then_computes_one_token() -> None:
    engine = Engine(TRANSFER)
    engine.add_request(remote(1, 101, 3, prefill=True))
    first = engine.step(0.0)
    assert first.duration == 0.0
    assert first.tokens == []
    assert engine.phase_of(1) == "transfer"
    ready = engine.next_ready_at()
    assert ready == pytest.approx(0.100)  # 100 tokens transferred (the last is computed)
    assert engine.snapshot().free_blocks == TRANSFER.num_gpu_blocks_override - 7  # 101 / 16
    engine.step(ready / 2)
    assert engine.phase_of(1) == "transfer"
    step = engine.step(ready)
    assert step.prefill_tokens == 1  # the prompt's last token, not its 101
    assert [e.index for e in step.tokens] == [0]
    assert engine.stats.kv_transfers == 1
    assert engine.stats.kv_transfer_tokens == 100


def test_transfers_do_not_hold_up_running_requests() -> None:
    engine = Engine(TRANSFER.replace(max_num_seqs=1))
    engine.add_request(remote(1, 500, 2, prefill=True))  # 0.5 s of transfer
    engine.add_request(req(2, 8, 5))
    events = run_with_transfers(engine)
    assert events[2][-1][0] < events[1][0][0]  # request 2 finished while 1's KV was arriving


def test_abort_during_transfer_frees_its_blocks() -> None:
    engine = Engine(TRANSFER)
    engine.add_request(remote(1, 200, 5, prefill=True))
    engine.step(0.0)
    assert engine.abort(1) == "transfer"
    assert engine.stats.aborted["transfer"] == 1
    assert engine.pool.num_free == TRANSFER.num_gpu_blocks_override
    assert not engine.has_work()
    assert engine.next_ready_at() is None


def test_locally_cached_prefix_is_not_transferred() -> None:
    engine = Engine(TRANSFER)
    shared = tuple(range(64))
    engine.add_request(req(1, list(shared), 1))
    run(engine)
    r = req(2, [*shared, *([999] * 16)], 2)
    engine.add_request(
        Request(2, r.prompt_ids, 2, "length", r.output, engine.clock, remote_prefill=True)
    )
    engine.step(engine.clock)
    assert engine.stats.kv_transfer_tokens == 80 - 1 - 64  # 4 cached blocks stay local


def run_with_transfers(engine: Engine) -> dict[int, list[tuple[float, Any]]]:
    """Like ``run``, but jumping the clock to the next transfer when nothing can run."""
    seen: dict[int, list[tuple[float, Any]]] = {}
    for _ in range(10_000):
        if not engine.has_work():
            return seen
        result = engine.step(engine.clock)
        if result.duration == 0:
            ready = engine.next_ready_at()
            assert ready is not None
            engine.clock = ready
        for ev in result.tokens:
            seen.setdefault(ev.request_id, []).append((engine.clock, ev))
    raise AssertionError("engine did not finish")


def test_kv_role_options() -> None:
    assert config_from_args(parse("--kv-role", "kv_producer")).kv_role == "kv_producer"
    nixl = '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'
    config = config_from_args(
        parse("--kv-transfer-config", nixl, "--sim-kv-transfer-us-per-token", "5")
    )
    assert (config.kv_role, config.kv_transfer_us_per_token) == ("kv_consumer", 5.0)
    assert config_from_args(parse()).kv_role is None
    with pytest.raises(ValueError, match="kv_role"):
        config_from_args(parse("--kv-transfer-config", '{"kv_connector":"NixlConnector"}'))
    with pytest.raises(ValueError, match="kv_role"):
        SimConfig(kv_role="prefill")  # type: ignore[arg-type]


async def test_prefill_then_decode_over_http() -> None:
    """The two-step protocol by hand: the prefill's parameters take the decode past its
    prefill, which then streams the whole answer."""
    prompt = "word " * 300
    async with (
        running_sim(FAST.replace(kv_role="kv_producer")) as p,
        running_sim(FAST.replace(kv_role="kv_consumer", kv_transfer_us_per_token=1.0)) as d,
        aiohttp.ClientSession() as client,
    ):
        body = completion_body(prompt, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)
        async with client.post(f"{p.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            answer = await resp.json()
        kv = answer["kv_transfer_params"]
        assert answer["usage"]["completion_tokens"] == 1
        assert kv["do_remote_prefill"] is True
        assert kv["do_remote_decode"] is False
        assert kv["remote_engine_id"] == p.state.engine_id
        assert (kv["remote_host"], kv["remote_port"]) == ("127.0.0.1", p.port)
        assert len(kv["remote_block_ids"]) == -(-(kv["remote_num_tokens"] + 1) // 16)
        assert kv["sim_request"].startswith(p.state.engine_id)
        assert p.state.prefills_handed_off == 1

        body = completion_body(prompt, max_tokens=5, ignore_eos=True, stream=True)
        body["kv_transfer_params"] = kv
        async with client.post(f"{d.url}/v1/completions", json=body) as resp:
            events = sse_events(await resp.read())
        assert len(events) == 6
        assert events[-1] == "[DONE]"
        assert d.engine.stats.kv_transfers == 1
        assert d.engine.stats.kv_transfer_tokens == kv["remote_num_tokens"] - 1
        assert d.engine.stats.prefix_cache_queries == kv["remote_num_tokens"]


async def test_without_a_connector_kv_transfer_params_are_ignored() -> None:
    async with running_sim(FAST) as sim, aiohttp.ClientSession() as client:
        body = completion_body("hello there", max_tokens=3, kv_transfer_params=PREFILL_PARAMS)
        async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
            answer = await resp.json()
        assert answer["kv_transfer_params"] is None
        incomplete = {"do_remote_prefill": True, "remote_engine_id": "x"}
        body = completion_body("hello there", max_tokens=3, kv_transfer_params=incomplete)
        async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
        assert sim.engine.stats.kv_transfers == 0


async def test_kv_transfer_params_must_be_an_object() -> None:
    async with running_sim(FAST) as sim, aiohttp.ClientSession() as client:
        body = completion_body("hello", kv_transfer_params=[1])
        async with client.post(f"{sim.url}/v1/completions", json=body) as resp:
            assert resp.status == 400
