"""Whatever a client sends, the answer is the backend's or a 4xx in OpenAI's envelope, and
nothing is left behind: no slot, no count, no metric series (issue 16: 3, 4 and the class).

The production configuration runs in a thread of its own, so hypothesis (synchronous) can
throw generated bodies and headers at it over real HTTP.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.production import ALIAS, KEYS, Production, auth, running_production

FIELDS = (
    "model", "messages", "prompt", "stream", "stream_options", "max_tokens",
    "max_completion_tokens", "n", "best_of", "temperature", "stop", "tools", "user",
    "min_tokens", "logprobs", "response_format", "seed", "ignore_eos",
)  # fmt: skip
MODELS = ("sim-model", ALIAS, "stable", "nope")
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | json_values},
        optional={"content": st.text(max_size=300) | json_values, "name": json_values},
    )
    | json_values,
    max_size=4,
)
bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(MODELS) | json_values},
    optional={
        **{f: json_values for f in FIELDS if f != "model"},
        "messages": messages | json_values,
        "prompt": st.text(max_size=600) | st.lists(st.integers(0, 100), max_size=8) | json_values,
        "stream": st.booleans() | json_values,
        "max_tokens": st.integers(-5, 40) | json_values,
    },
)
raw_bodies = (
    st.binary(max_size=200)
    | st.just(b'{"model":"sim-model","x":' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    | st.just(b'{"model":"sim-model","prompt":"\\ud800 and more"}')
    | st.just(b'{"model":"\\udfff"}')
    | st.just(b'{"model":"sim-model","prompt":"x","max_tokens":1e999}')
    | st.just(b"[1,2]")
    | st.just(b'"text"')
)
header_values = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30)
headers = st.fixed_dictionaries(
    {},
    optional={
        "x-priority": header_values,
        "x-session-id": header_values,
        "x-request-id": header_values,
        "traceparent": header_values,
        "content-type": st.sampled_from(["application/json", "text/plain", "", "x/y; q=1"]),
    },
)
PATHS = ("/v1/chat/completions", "/v1/completions")


@dataclass
class Hosted:
    prod: Production
    loop: asyncio.AbstractEventLoop

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)


@pytest.fixture(scope="module")
def hosted(redis_url: str) -> Iterator[Hosted]:
    """The production gateway on an event loop in another thread, for the whole module."""
    prefix = "test-bad-input:"
    started: Future[Hosted] = Future()
    stop: asyncio.Event | None = None
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        async with running_production(redis_url, prefix, log_level="error") as prod:
            started.set_result(Hosted(prod, loop))
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield started.result(30)
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match=prefix + "*"))
        if keys:
            client.delete(*keys)
        client.close()


def check_answer(r: httpx.Response) -> None:
    """The backend's answer (the simulator validates like vLLM), or the gateway's 4xx."""
    assert r.status_code < 500 or r.status_code in (502, 503, 504), (r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str)
        assert isinstance(err["type"], str)
        assert set(err) >= {"message", "type", "param", "code"}


common = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@common
@given(body=bodies, hdrs=headers, path=st.sampled_from(PATHS), key=st.sampled_from(sorted(KEYS)))
def test_generated_json_bodies_get_an_answer_never_a_gateway_failure(
    hosted: Hosted, body: dict[str, Any], hdrs: dict[str, str], path: str, key: str
) -> None:
    data = json.dumps(body).encode()
    with httpx.Client(timeout=30) as c:
        r = c.post(
            hosted.prod.url + path,
            content=data,
            headers={"content-type": "application/json", **hdrs, **auth(key)},
        )
    check_answer(r)


@common
@given(raw=raw_bodies, path=st.sampled_from(PATHS))
def test_bodies_that_are_not_json_objects_are_400(hosted: Hosted, raw: bytes, path: str) -> None:
    with httpx.Client(timeout=30) as c:
        r = c.post(hosted.prod.url + path, content=raw, headers=auth("alice"))
    check_answer(r)
    try:
        doc = json.loads(raw)
        valid = isinstance(doc, dict) and json.dumps(doc, ensure_ascii=False).encode()
    except (ValueError, RecursionError, UnicodeEncodeError):
        valid = False
    if not valid:
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "invalid_json"


def test_after_the_onslaught_nothing_is_held_and_metric_series_are_bounded(
    hosted: Hosted, redis_url: str
) -> None:
    """After random model names (and the generated tests before, in this module): no lease,
    slot, Redis concurrency key or per-model series was left behind."""
    with httpx.Client(timeout=30) as c:
        first = c.get(hosted.prod.url + "/metrics")
        assert first.status_code == 200  # a client's name in a label once made this a 500
        before = first.text.count("\n")
        for i in range(50):
            body = {"model": f"random-{i}-{'x' * i}", "prompt": "hi", "max_tokens": 2}
            r = c.post(hosted.prod.url + "/v1/completions", json=body, headers=auth("bob"))
            assert r.status_code == 404
        last = c.get(hosted.prod.url + "/metrics")
        assert last.status_code == 200
        text = last.text
    svc = hosted.prod.gateway.svc

    async def settled() -> tuple[dict[str, int], int, int]:
        admission = svc.admission
        assert admission is not None
        for _ in range(500):
            flights = {b.id: b.in_flight for b in svc.pool.all()}
            if not any(flights.values()) and admission.holding == 0 and admission.waiting == 0:
                break
            await asyncio.sleep(0.01)  # sleep-ok: polling with a bound of 5 s
        return flights, admission.holding, admission.waiting

    flights, holding, waiting = hosted.call(settled())
    assert flights == {"sim0": 0, "sim1": 0, "sim2": 0}
    assert (holding, waiting) == (0, 0)
    client = redis.Redis.from_url(redis_url)
    try:
        slots = sum(client.zcard(k) for k in client.scan_iter(match="test-bad-input:*:c"))
    finally:
        client.close()
    assert slots == 0
    models = {
        line.split('model="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if line.startswith("llm_gateway_requests_total{")
    }
    assert models <= {"sim-model", ALIAS, "other"}, models
    # 50 new model names add no series (the 404s land on existing "other" series, at most
    # one new status and its duration histogram).
    assert text.count("\n") - before < 40
