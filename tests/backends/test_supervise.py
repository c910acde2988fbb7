"""Background loops are supervised: a crash is logged, counted and the loop runs again."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from structlog.testing import capture_logs

from backends.supervise import Supervisor
from tests.helpers import FakeBackend, gateway_for, wait_for


async def test_a_crashing_loop_is_restarted_with_a_growing_backoff_and_counted() -> None:
    runs: list[float] = []
    loop = asyncio.get_running_loop()

    async def flaky() -> None:
        runs.append(loop.time())
        if len(runs) < 4:
            raise RuntimeError(f"crash {len(runs)}")

    sup = Supervisor(backoff_base=0.02, backoff_max=1.0)
    with capture_logs() as logs:
        await asyncio.wait_for(sup.spawn("scrape", "scrape:x", flaky), 5)
    assert len(runs) == 4
    gaps = [b - a for a, b in itertools.pairwise(runs)]
    assert gaps[0] >= 0.02
    assert gaps[1] >= 0.04
    assert gaps[2] >= 0.08
    assert sup.restarts["scrape"] == 3
    failed = [e for e in logs if e["event"] == "background_task_failed"]
    assert [e["task"] for e in failed] == ["scrape:x"] * 3
    assert all(e["exc_info"] for e in failed)


async def test_cancelling_a_supervised_loop_stops_it() -> None:
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    task = Supervisor().spawn("probe", "probe:x", forever)
    await started.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()


async def test_the_gateways_scrape_loop_survives_a_crash_and_says_so() -> None:
    """Issue 16.11: a loop that raised ended silently, and routing ran on frozen figures."""
    fake = FakeBackend()
    async with gateway_for(fake, scrape={"interval": 0.02}) as (gw, s):
        pool = gw.svc.pool
        real = pool.record_load
        crashed: list[bool] = []

        def crash_once(*args: Any, **kwargs: Any) -> None:
            if not crashed:
                crashed.append(True)
                raise KeyError("a bug in the scrape path")
            real(*args, **kwargs)

        with capture_logs() as logs:
            pool.record_load = crash_once  # type: ignore[method-assign]
            await wait_for(lambda: bool(crashed), what="the crash")
            at_crash = pool.all()[0].load_at
            await wait_for(lambda: pool.all()[0].load_at > at_crash, within=5, what="scrapes again")
        async with s.get(gw.url + "/metrics") as r:
            text = await r.text()
    assert any(e["event"] == "background_task_failed" and e["kind"] == "scrape" for e in logs)
    assert 'llm_gateway_background_task_restarts_total{task="scrape"} 1.0' in text
