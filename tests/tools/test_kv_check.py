"""``llm-gateway kv-events check`` against simulators: one that publishes events (and one whose
events are in the old positional form with bytes hashes), and one that publishes none."""

from __future__ import annotations

import argparse

from tools.kv_check import add_arguments, check
from tools.sim import FAST, running_sim
from tools.sim.kvevents import KvEventsConfig


def args_for(url: str, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args([url, "--timeout", "5", *extra])


def events(**extra: str) -> KvEventsConfig:
    return KvEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", **extra
    )


async def test_a_publishing_backend_passes_with_block_size_tokens_and_replay() -> None:
    async with running_sim(FAST.replace(kv_events=events())) as sim:
        report = await check(args_for(sim.url, "--tokenizer", "sim"))
    text = report.render()
    assert report.ok, text
    assert "block size 16" in text
    assert "wire form tagged, hashes int" in text
    assert "the events carry the prompt's tokens" in text
    assert "the gateway's tokenizer (sim) agrees with the engine" in text
    assert "the replay socket answers" in text


async def test_the_old_wire_form_and_bytes_hashes_are_read_too() -> None:
    async with running_sim(
        FAST.replace(kv_events=events(wire="positional", hashes="bytes"))
    ) as sim:
        report = await check(args_for(sim.url))
    assert report.ok, report.render()
    assert "wire form positional, hashes bytes" in report.render()


async def test_a_backend_without_events_fails_and_says_how_to_fix_it() -> None:
    async with running_sim(FAST) as sim:
        report = await check(args_for(sim.url))
    assert not report.ok
    assert "--kv-events-config" in report.render()


async def test_a_tokenizer_that_cannot_be_loaded_fails() -> None:
    async with running_sim(FAST.replace(kv_events=events())) as sim:
        report = await check(args_for(sim.url, "--tokenizer", "/nonexistent/model"))
    assert not report.ok
    assert "the gateway's tokenizer" in report.render()
