"""``--scheduling-policy priority``, as vLLM 0.32: requests' priorities (the body's field, the
X-Vllm-Priority header over it) order the queue, preemption takes the least important
running request, fcfs ignores them, and bad values are refused as vLLM's validation does."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import defaultdict
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import wait_for
from tools.sim import FAST, SimConfig, running_sim
from tools.sim.cli import add_arguments, config_from_args
from tools.sim.engine import Engine, Request, TokenEvent
from tools.sim.priority import body_priority, with_header
from tools.sim.tokens import OutputText
from tools.sim.validation import BodyError
from tools.sim.waiting import PriorityQueue

from .conftest import chat_body, completion_body

PRIORITY = FAST.replace(scheduling_policy="priority")
BLOCKER: dict[str, Any] = {"max_tokens": 4000, "ignore_eos": True, "stream": True}
# 32 blocks of 4 tokens: two requests of 16 prompt and 40 output tokens fit, three do not.
TIGHT_KV = {"block_size": 4, "num_gpu_blocks_override": 32, "max_model_len": 64}
ENGINE = SimConfig(
    step_base_ms=10.0,
    prefill_us_per_token=100.0,
    decode_us_per_seq=100.0,
    attention_ns_per_token=0.0,
).replace(**TIGHT_KV)


# -- the engine, pure


def request(rid: int, out: int, *, priority: int = 0, arrival: float = 0.0) -> Request:
    prompt = tuple(range(1000 * rid, 1000 * rid + 16))
    return Request(rid, prompt, out, "length", OutputText(seed=rid), arrival, priority=priority)


def run(engine: Engine) -> tuple[list[int], dict[int, list[TokenEvent]], list[int]]:
    """Step until idle: the order of first tokens, each request's events, the preempted."""
    first: list[int] = []
    events: dict[int, list[TokenEvent]] = defaultdict(list)
    preempted: list[int] = []
    for _ in range(10_000):
        if not engine.has_work():
            return first, events, preempted
        result = engine.step(engine.clock)
        preempted += result.preempted
        for ev in result.tokens:
            if ev.index == 0:
                first.append(ev.request_id)
            events[ev.request_id].append(ev)
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize(("policy", "order"), [("priority", [4, 3, 5, 2]), ("fcfs", [2, 3, 4, 5])])
def test_the_queue_is_ordered_by_priority_then_arrival(policy: str, order: list[int]) -> None:
    engine = Engine(ENGINE.replace(max_num_seqs=1, scheduling_policy=policy))
    priorities = {1: 0, 2: 3, 3: 1, 4: -2, 5: 1}
    engine.add_request(request(1, 4, arrival=0.0))
    engine.step(0.0)  # 1 runs (its first token out); the others arrive while it does
    for rid in (2, 3, 4, 5):
        engine.add_request(request(rid, 4, priority=priorities[rid], arrival=rid / 1000))
    first, _, _ = run(engine)
    assert first == order


@pytest.mark.parametrize(("policy", "victim"), [("priority", 1), ("fcfs", 3)])
def test_kv_exhaustion_preempts_the_least_important_running_request(
    policy: str, victim: int
) -> None:
    """Under priority the victim is the highest priority value, even admitted first and
    already scheduled in the step (its tokens go back to the budget); under fcfs the last
    admitted. Either way it is recomputed later and its tokens continue where they were."""
    engine = Engine(ENGINE.replace(scheduling_policy=policy))
    engine.add_request(request(1, 40, priority=5, arrival=0.0))
    head = engine.step(0.0).tokens  # 1 is admitted first (its first token out)
    engine.add_request(request(2, 40, arrival=0.001))
    engine.add_request(request(3, 40, arrival=0.002))
    _, events, preempted = run(engine)
    events[1][:0] = head
    assert preempted, "the KV cache never ran out"
    assert set(preempted) == {victim}
    assert engine.stats.num_preemptions == len(preempted)
    for rid in (1, 2, 3):
        assert [ev.index for ev in events[rid]] == list(range(40))
        assert events[rid][-1].finish_reason == "length"
    assert engine.stats.request_success["length"] == 3


def test_a_waiting_request_does_not_preempt_by_itself() -> None:
    """vLLM 0.32 admits a waiting request only into a free slot: an important one waits for
    the batch to have room, then goes before the rest of the queue."""
    engine = Engine(ENGINE.replace(max_num_seqs=2, scheduling_policy="priority"))
    engine.add_request(request(1, 8, priority=9))
    engine.add_request(request(2, 8, priority=9, arrival=0.001))
    engine.step(0.0)
    engine.add_request(request(3, 8, priority=9, arrival=0.002))
    engine.add_request(request(4, 8, priority=-9, arrival=0.003))
    engine.step(engine.clock)
    assert [s.req.request_id for s in engine.running] == [1, 2]
    assert [s.req.request_id for s in engine.waiting] == [4, 3]
    first, _, preempted = run(engine)
    assert first == [4, 3]
    assert preempted == []


def test_the_preempted_request_goes_back_behind_more_important_ones() -> None:
    """The slot and blocks a preemption frees go to the most important waiting request."""
    engine = Engine(ENGINE.replace(max_num_seqs=3, scheduling_policy="priority"))
    engine.add_request(request(1, 40, priority=5))
    engine.add_request(request(2, 40, arrival=0.001))
    engine.add_request(request(3, 40, arrival=0.002))
    engine.step(0.0)  # all three admitted: the batch is full
    engine.add_request(request(4, 4, priority=-1, arrival=0.003))
    while not engine.stats.num_preemptions:
        engine.step(engine.clock)
    assert [s.req.request_id for s in engine.waiting] == [4, 1]
    first, _, _ = run(engine)
    assert first == [4]  # readmitted before 1


def test_the_priority_queue_removes_and_iterates_in_order() -> None:
    class Item:
        def __init__(self, order: tuple[int, float, int]) -> None:
            self.order = order

    items = [Item((p, t, i)) for i, (p, t) in enumerate([(1, 0.0), (0, 0.5), (0, 0.2), (-1, 9.0)])]
    queue: PriorityQueue[Item] = PriorityQueue()
    for item in items:
        queue.add(item)
    assert list(queue) == [items[3], items[2], items[1], items[0]]
    queue.remove(items[2])
    assert queue.peek() is items[3]
    assert [queue.pop(), queue.pop(), queue.pop()] == [items[3], items[1], items[0]]
    assert not queue


# -- reading a priority


@pytest.mark.parametrize(
    ("body", "expected"),
    [({}, 0), ({"priority": -3}, -3), ({"priority": "7"}, 7), ({"priority": 2.0}, 2),
     ({"priority": True}, 1), ({"priority": 2**63 - 1}, 2**63 - 1)],
)  # fmt: skip
def test_body_priority_takes_what_vllms_field_takes(body: dict[str, Any], expected: int) -> None:
    assert body_priority(body) == expected


def test_the_header_overrides_the_body_when_int_reads_it() -> None:
    assert with_header(4, None) == 4
    assert with_header(4, "-10") == -10
    assert with_header(4, " 2 ") == 2
    assert with_header(4, "urgent") == 4  # ignored, as vLLM's _get_priority does
    assert with_header(4, "1.5") == 4


# vLLM 0.32's pydantic errors for ChatCompletionRequest(priority=...), as its handler prints
# them: (the value, the error's type, msg, input as shown, ctx as shown)
Bad = tuple[Any, str, str, str, str]
BAD: list[Bad] = [
    ("high", "int_parsing", "Input should be a valid integer, unable to parse string as an "
     "integer", "'high'", ""),
    (1.5, "int_from_float", "Input should be a valid integer, got a number with a fractional "
     "part", "'1.5'", ""),
    (None, "int_type", "Input should be a valid integer", "'None'", ""),
    ([1], "int_type", "Input should be a valid integer", "'<list of 1 items>'", ""),
    (2**63, "less_than_equal", "Input should be less than or equal to 9223372036854775807",
     "'9223372036854775808'", ", 'ctx': {'le': 9223372036854775807}"),
    (-(2**63) - 1, "greater_than_equal",
     "Input should be greater than or equal to -9223372036854775808",
     "'-9223372036854775809'", ", 'ctx': {'ge': -9223372036854775808}"),
]  # fmt: skip


def expected_error(bad: Bad) -> dict[str, Any]:
    """vLLM's 400 for one bad ``priority``: pydantic's error as its handler prints it."""
    _, kind, msg, shown, ctx = bad
    error = f"{{'type': '{kind}', 'loc': 'body.priority', 'msg': '{msg}', 'input': {shown}{ctx}}}"
    return {
        "error": {
            "message": f"1 validation error:\n  {error}",
            "type": "Bad Request",
            "param": "body.priority",
            "code": 400,
        }
    }


@pytest.mark.parametrize("bad", BAD, ids=lambda bad: bad[1])
def test_a_bad_body_priority_is_vllms_validation_error(bad: Bad) -> None:
    with pytest.raises(BodyError) as caught:
        body_priority({"priority": bad[0]})
    assert caught.value.envelope() == expected_error(bad)


# -- over HTTP


def test_the_option() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).scheduling_policy == "fcfs"
    args = parser.parse_args(["--scheduling-policy", "priority"])
    assert config_from_args(args).scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "sjf"])  # not in vLLM 0.32
    with pytest.raises(ValueError, match="scheduling_policy"):
        SimConfig(scheduling_policy="sjf")  # type: ignore[arg-type]


async def first_token(
    client: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    name: str,
    seen: list[str],
    *,
    headers: dict[str, str] | None,
) -> None:
    """Stream a chat completion, noting ``name`` in ``seen`` at its first token."""
    async with client.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content":""' not in line:
                seen.append(name)
                break
        await resp.read()


async def queue_behind_a_blocker(
    client: aiohttp.ClientSession,
    config: SimConfig,
    requests: list[tuple[str, dict[str, Any], dict[str, str] | None]],
) -> list[str]:
    """One request runs (``max_num_seqs`` 1) while ``requests`` are sent one after the
    other and queue; then it goes away: the order of their first tokens."""
    async with running_sim(config.replace(max_num_seqs=1)) as sim:
        blocker = await client.post(f"{sim.url}/v1/completions", json=completion_body(**BLOCKER))
        seen: list[str] = []
        tasks = []
        for n, (name, body, headers) in enumerate(requests, start=1):
            tasks.append(
                asyncio.create_task(first_token(client, sim.url, body, name, seen, headers=headers))
            )
            await wait_for(lambda n=n: len(sim.engine.waiting) == n, what=f"{name} queued")
        assert not seen
        blocker.close()  # the slot frees: the queue runs in its order
        async with asyncio.timeout(10):
            await asyncio.gather(*tasks)
        return seen


SHORT: dict[str, Any] = {"max_tokens": 2, "stream": True}


async def test_a_high_priority_request_sent_last_gets_its_first_token_first(
    client: aiohttp.ClientSession,
) -> None:
    requests: list[tuple[str, dict[str, Any], dict[str, str] | None]] = [
        ("low 1", chat_body("one", priority=1, **SHORT), None),
        ("default", chat_body("two", **SHORT), None),
        ("low 2", chat_body("three", priority=1, **SHORT), None),
        ("high", chat_body("four", priority=-10, **SHORT), None),
    ]
    assert await queue_behind_a_blocker(client, PRIORITY, requests) == [
        "high", "default", "low 1", "low 2",
    ]  # fmt: skip


async def test_fcfs_accepts_the_priority_and_ignores_it(client: aiohttp.ClientSession) -> None:
    requests: list[tuple[str, dict[str, Any], dict[str, str] | None]] = [
        ("low", chat_body("one", priority=1, **SHORT), None),
        ("header", chat_body("two", **SHORT), {"X-Vllm-Priority": "-5"}),
        ("high", chat_body("three", priority=-10, **SHORT), None),
    ]
    assert await queue_behind_a_blocker(client, FAST, requests) == ["low", "header", "high"]


async def test_the_header_overrides_the_body(client: aiohttp.ClientSession) -> None:
    requests: list[tuple[str, dict[str, Any], dict[str, str] | None]] = [
        ("body 0", chat_body("one", **SHORT), None),
        ("body 10, header -5", chat_body("two", priority=10, **SHORT), {"X-Vllm-Priority": "-5"}),
        ("body -20, header 20", chat_body("three", priority=-20, **SHORT),
         {"X-Vllm-Priority": "20"}),
        ("body -1, bad header", chat_body("four", priority=-1, **SHORT),
         {"X-Vllm-Priority": "urgent"}),
    ]  # fmt: skip
    assert await queue_behind_a_blocker(client, PRIORITY, requests) == [
        "body 10, header -5", "body -1, bad header", "body 0", "body -20, header 20",
    ]  # fmt: skip


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
async def test_every_api_passes_its_priority_to_the_engine(
    client: aiohttp.ClientSession, policy: str
) -> None:
    """Body and header where vLLM reads them: the Messages API has only the header,
    generate only the body."""
    h = "X-Vllm-Priority"
    sent: list[tuple[str, dict[str, Any], dict[str, str]]] = [
        ("/v1/chat/completions", chat_body(priority=3, **BLOCKER), {h: "1"}),
        ("/v1/completions", completion_body(priority=2, **BLOCKER), {}),
        ("/v1/responses", {"input": "hi", "stream": True, "priority": 9}, {h: "4"}),
        ("/v1/messages", {"model": FAST.model_name, "max_tokens": 50, "stream": True,
                          "messages": [{"role": "user", "content": "hi"}]}, {h: "5"}),
        ("/v1/messages", {"model": FAST.model_name, "max_tokens": 50, "stream": True,
                          "priority": 7, "messages": [{"role": "user", "content": "hi"}]}, {}),
        ("/inference/v1/generate", {"token_ids": [1, 2], "stream": True, "priority": 6,
                                    "sampling_params": {"max_tokens": 50}}, {h: "-8"}),
    ]  # fmt: skip
    config = FAST.replace(max_num_seqs=1, enable_scale_out=True, scheduling_policy=policy)
    async with running_sim(config) as sim:
        blocker = await client.post(f"{sim.url}/v1/completions", json=completion_body(**BLOCKER))
        responses = [blocker]
        try:
            for n, (path, body, headers) in enumerate(sent, start=1):
                resp = await client.post(f"{sim.url}{path}", json=body, headers=headers)
                assert resp.status == 200, await resp.text()
                responses.append(resp)
                await wait_for(lambda n=n: len(sim.engine.waiting) == n, what=f"{path} queued")
            queued = [s.req.priority for s in sim.engine.waiting]
        finally:
            for resp in responses:
                resp.close()
    if policy == "priority":
        assert queued == [0, 1, 2, 4, 5, 6]
    else:
        assert queued == [1, 2, 4, 5, 0, 6]


@pytest.mark.parametrize("bad", [BAD[0], BAD[2], BAD[4]], ids=lambda bad: bad[1])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat_body()),
        ("/v1/completions", completion_body()),
        ("/v1/responses", {"input": "hi"}),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 2}}),
    ],
)
async def test_a_bad_priority_is_refused_as_vllm_does(
    client: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    bad: Bad,
) -> None:
    async with running_sim(FAST.replace(enable_scale_out=True)) as sim:  # fcfs checks it too
        async with client.post(f"{sim.url}{path}", json={**body, "priority": bad[0]}) as resp:
            assert resp.status == 400
            assert await resp.json() == expected_error(bad)
        assert sim.engine.stats.steps == 0


async def test_pooling_checks_the_priority(client: aiohttp.ClientSession) -> None:
    async with running_sim(FAST.replace(runner="pooling")) as sim:
        url = f"{sim.url}/v1/embeddings"
        body = {"model": FAST.model_name, "input": "hi"}
        async with client.post(url, json={**body, "priority": -4}) as resp:
            assert resp.status == 200
        async with client.post(url, json={**body, "priority": "high"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "body.priority"


async def test_a_bad_header_is_ignored_not_refused(client: aiohttp.ClientSession) -> None:
    async with running_sim(PRIORITY) as sim:
        headers = {"X-Vllm-Priority": "soon"}
        body = chat_body(priority=2, max_tokens=2)
        async with client.post(f"{sim.url}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
            assert (await r.json())["usage"]["completion_tokens"] == 2


async def stream_to_the_end(
    client: aiohttp.ClientSession, url: str, name: str, priority: int, done: list[str]
) -> list[dict[str, Any]]:
    words = " ".join(f"{name}{i}" for i in range(16))
    body = completion_body(words, max_tokens=40, ignore_eos=True, stream=True, priority=priority)
    chunks: list[dict[str, Any]] = []
    async with client.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[len(b"data: ") :]))
            elif line.startswith(b"data: [DONE]"):
                done.append(name)
    return chunks


@pytest.mark.parametrize(("policy", "victim"), [("priority", "a"), ("fcfs", "c")])
async def test_a_full_kv_cache_preempts_counted_and_streams_only_pause(
    client: aiohttp.ClientSession, policy: str, victim: str
) -> None:
    """Three 16-token prompts, 40 tokens each, in a KV cache for two: the least
    important request ("a", priority 5, sent first; under fcfs the last admitted, "c") is
    preempted, again and again, and finishes last; every stream is whole, without error."""
    config = FAST.replace(scheduling_policy=policy, **TIGHT_KV)
    async with running_sim(config) as sim:
        sim.driver.pause("paused_all")  # the three start together
        done: list[str] = []
        tasks = []
        for n, (name, priority) in enumerate([("a", 5), ("b", 0), ("c", 0)], start=1):
            tasks.append(
                asyncio.create_task(stream_to_the_end(client, sim.url, name, priority, done))
            )
            await wait_for(lambda n=n: len(sim.engine.waiting) == n, what=f"{name} queued")
        sim.driver.resume()
        async with asyncio.timeout(20):
            streams = await asyncio.gather(*tasks)
        async with client.get(f"{sim.url}/metrics") as resp:
            text = await resp.text()
    for chunks in streams:
        assert len(chunks) == 40
        assert all("error" not in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert done[-1] == victim
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = families["vllm:num_preemptions"].samples
    assert sample.name == "vllm:num_preemptions_total"
    assert sample.value == sim.engine.stats.num_preemptions >= 1
