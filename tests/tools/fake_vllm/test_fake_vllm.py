"""The fake vLLM's own answers (``tools.fake_vllm.vllm``): vLLM's bytes, one id per request, the
paced schedule, vLLM's 400s; and the fake as the benchmarks run it, a process that needs
nothing of the repository but its own package."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import aiohttp

from tests.helpers import serve_app
from tools.fake_vllm import create_app
from tools.fake_vllm.vllm import Asked, chunks, whole

ROOT = Path(__file__).resolve().parents[3]


def chat(tokens: int, *, stream: bool = True, usage: bool = False) -> dict[str, object]:
    body: dict[str, object] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": tokens,
        "stream": stream,
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


def test_a_chat_stream_is_vllms_bytes() -> None:
    a = Asked(chat=True, model="tiny", tokens=2, stream=True, include_usage=True, prompt_tokens=6)
    c = chunks(a, "chatcmpl-1", 7)
    head = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"tiny",'
    assert c.opening == head + (
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        b'"logprobs":null,"finish_reason":null}]}\n\n'
    )
    assert [c.token(i, 2) for i in range(2)] == [
        head + b'"choices":[{"index":0,"delta":{"content":" the"},"logprobs":null,'
        b'"finish_reason":null}]}\n\n',
        head + b'"choices":[{"index":0,"delta":{"content":" quick"},"logprobs":null,'
        b'"finish_reason":"length","stop_reason":null}]}\n\n',
    ]
    assert c.usage == head + (
        b'"choices":[],"usage":{"prompt_tokens":6,"total_tokens":8,"completion_tokens":2}}\n\n'
    )


def test_completion_chunks_all_carry_a_stop_reason_and_the_words_cycle() -> None:
    a = Asked(chat=False, model="m%s", tokens=18, stream=True, include_usage=False, prompt_tokens=1)
    c = chunks(a, "cmpl-1", 0)
    assert c.opening is None
    assert c.usage is None
    events = [json.loads(c.token(i, 18)[6:]) for i in range(18)]
    assert [e["choices"][0]["text"] for e in events[15:]] == [".", " the", " quick"]
    assert all(e["choices"][0]["stop_reason"] is None for e in events)
    assert [e["choices"][0]["finish_reason"] for e in events[-2:]] == [None, "length"]
    assert {e["model"] for e in events} == {"m%s"}


def test_an_answer_not_streamed_is_vllms_json() -> None:
    a = Asked(chat=True, model="tiny", tokens=3, stream=False, include_usage=False, prompt_tokens=4)
    doc = whole(a, "chatcmpl-1", 7)
    assert doc["object"] == "chat.completion"
    assert doc["choices"][0]["message"]["content"] == " the quick brown"
    assert doc["choices"][0]["finish_reason"] == "length"
    assert doc["usage"] == {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}


async def test_each_request_has_its_own_id_on_every_chunk() -> None:
    async with serve_app(create_app()) as url, aiohttp.ClientSession() as s:
        ids = []
        for _ in range(2):
            async with s.post(url + "/v1/chat/completions", json=chat(3, usage=True)) as r:
                events = [e for e in (await r.read()).split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            ids.append({json.loads(e[6:])["id"] for e in events[:-1]})
    assert [len(i) for i in ids] == [1, 1]
    assert ids[0] != ids[1]
    assert next(iter(ids[0])).startswith("chatcmpl-")


async def test_paced_tokens_keep_an_absolute_schedule() -> None:
    ttft, itl = 0.03, 0.01
    async with serve_app(create_app(ttft_ms=ttft * 1e3, itl_ms=itl * 1e3)) as url:
        async with aiohttp.ClientSession() as s:
            sent = time.perf_counter()
            async with s.post(url + "/v1/chat/completions", json=chat(5)) as r:
                seen, at = 0, []
                async for data in r.content.iter_any():
                    now = time.perf_counter() - sent
                    n = data.count(b'"content":"') - data.count(b'"content":""')
                    at += [now] * n
                    seen += n
    assert seen == 5
    # token i leaves no earlier than ttft + i x itl after the request arrived
    assert all(t >= ttft + i * itl for i, t in enumerate(at)), at


async def test_a_body_vllm_refuses_is_its_400() -> None:
    async with serve_app(create_app()) as url, aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", data=b"{") as r:
            assert r.status == 400
            doc = await r.json()
        async with s.post(url + "/v1/completions", json={"max_tokens": "x"}) as r:
            assert r.status == 400
    assert doc == {
        "object": "error",
        "message": "invalid JSON body",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


async def test_it_runs_as_a_module_from_anywhere_with_the_checkout_on_the_path(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tools.fake_vllm", "--port", "0", "--model", "tiny",
        cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        url = line.split(" on ")[1].strip()
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", json=chat(2, stream=False)) as r:
                doc = await r.json()
            async with s.get(url + "/metrics") as r:
                metrics = await r.text()
    finally:
        proc.terminate()
        await proc.wait()
    assert doc["choices"][0]["message"]["content"] == " the quick"
    assert 'vllm:generation_tokens_total{engine="0",model_name="tiny"} 2.0' in metrics


def test_it_imports_nothing_of_ours_but_itself() -> None:
    """So a bench Python with aiohttp alone runs it."""
    allowed = {"aiohttp", "multidict", "uvloop", "tools"}
    found = set()
    for path in (ROOT / "tools" / "fake_vllm").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
    outside = {
        name
        for name in found
        if name.split(".")[0] not in sys.stdlib_module_names | allowed
        or (name.startswith("tools") and not name.startswith("tools.fake_vllm"))
    }
    assert outside == set()
