"""End-to-end fixtures: two real vLLM servers (CPU build) on a tiny model, the gateway in
front of them, and the official ``openai`` client pointed at the gateway.

The servers start once per session (about a minute on 2 cores) and are killed at the end. If
the vLLM virtualenv is missing every test here fails, saying to run scripts/install_vllm.sh:
a machine that cannot run these tests must not pass them by skipping.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Final

import httpx
import openai
import pytest

from tests.e2e.observe import RUNNING, WAITING, fleet_total, poll_until
from tests.e2e.servers import (
    START_DEADLINE,
    VllmServer,
    VllmUnavailable,
    gateway_for,
    running_vllm_servers,
    vllm_python,
)
from tests.helpers import RunningGateway

N_SERVERS = 2


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: runs against real vLLM servers (tests/e2e)")


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    """Mark the e2e tests; give the first one that starts the servers their start-up time on
    top of the usual per-test timeout (pytest-timeout counts fixture set-up)."""
    yield  # after every other hook, deselection included
    e2e = [item for item in items if "tests/e2e/" in item.nodeid]
    for item in e2e:
        item.add_marker(pytest.mark.e2e)
        # Two real servers, the gateway and the tests share two cores: a test that lost a race
        # for the CPU (seen as multi-second connect stalls) gets one more try, after a pause
        # for the servers to go idle. A test that fails twice fails the run.
        item.add_marker(pytest.mark.flaky(reruns=1, reruns_delay=10))
    starters = [i for i in e2e if "vllm_servers" in getattr(i, "fixturenames", ())]
    if starters:
        starters[0].add_marker(pytest.mark.timeout(START_DEADLINE + 120))


STARTED = pytest.StashKey[str]()
SCALE_OUT: Final = "vllm1"  # the one server with the token-in and render routes
# The one server that schedules by priority (tests/e2e/test_priority.py); requests of equal
# priority (every other test's) run in arrival order there, as under fcfs
PRIORITY: Final = "vllm0"


# Tool calls (Anthropic's tool_use through /v1/messages): vLLM needs a parser for them, even
# for a named tool: the pythonic one, which needs no special token the tiny model lacks.
# No whitespace in a call's JSON: a random model would pad it to max_tokens.
TOOLS: Final = (
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "pythonic",
    "--structured-outputs-config",
    '{"backend": "xgrammar", "disable_any_whitespace": true}',
)


def engine_args(name: str) -> Sequence[str]:
    """Tool calls on both servers; vLLM's scale-out routes (``/inference/v1/generate``, the
    render routes) on one only: the other answers them 403, and the gateway must pass it
    over for them."""
    return [
        *TOOLS,
        *(["--enable-scale-out"] if name == SCALE_OUT else []),
        *(["--scheduling-policy", "priority"] if name == PRIORITY else []),
    ]


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Say how long the real servers took to start, so CI logs show the e2e cost."""
    if STARTED in config.stash:
        terminalreporter.write_line(config.stash[STARTED])


@pytest.fixture(scope="session")
def vllm_servers(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[list[VllmServer]]:
    try:
        vllm_python()
    except VllmUnavailable as exc:
        pytest.fail(f"end-to-end tests need real vLLM: {exc}", pytrace=False)
    started = time.monotonic()
    log_dir = tmp_path_factory.mktemp("vllm")
    with running_vllm_servers(N_SERVERS, log_dir, extra=engine_args) as servers:
        pytestconfig.stash[STARTED] = (
            f"e2e: {len(servers)} vLLM servers healthy {time.monotonic() - started:.1f}s after "
            f"the fixture began (model build and venv check included); logs in {log_dir}"
        )
        yield servers


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    # Generous: another process on a shared machine can stall a server for seconds. Only the
    # abort tests hold a server to a deadline (it must not still be running a second after).
    # uvicorn closes idle keep-alive connections after 5 s; a request racing that close fails
    # with "Server disconnected" for nothing, so idle connections are dropped sooner here.
    limits = httpx.Limits(keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        yield client


@pytest.fixture
async def servers(vllm_servers: list[VllmServer], http: httpx.AsyncClient) -> list[VllmServer]:
    """The servers, once nothing from an earlier test is still running or queued on them."""

    async def busy() -> float:
        return await fleet_total(http, vllm_servers, RUNNING) + await fleet_total(
            http, vllm_servers, WAITING
        )

    await poll_until(busy, lambda n: n == 0, within=30.0, what="idle servers before the test")
    return vllm_servers


@pytest.fixture
async def gateway(servers: list[VllmServer]) -> AsyncIterator[RunningGateway]:
    """The gateway in-process, routing to every server, once it has read their model lists."""
    async with gateway_for(servers) as gw:
        yield gw


@pytest.fixture
async def client(gateway: RunningGateway) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official OpenAI client, through the gateway. No retries: each call is one request."""
    async with openai.AsyncOpenAI(
        base_url=f"{gateway.url}/v1", api_key="not-checked", max_retries=0, timeout=60.0
    ) as oai:
        yield oai
