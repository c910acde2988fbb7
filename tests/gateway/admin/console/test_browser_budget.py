"""The retry budget and the admission queue's sheddings in the console, in a real headless
Chromium: a gateway whose limits (and so its budget) are on a Redis of the test's own took
retries and was refused some, and shed a request by priority (``tests.budget_and_shed``); the
page shows the counts the admin API gives, says the budget is the fleet's, then that the
replica decides alone while that Redis is paused, and the fleet's again once it answers."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from gateway.request.services import Services
from tests import budget_and_shed
from tests.gateway.admin.console.page import opened, sign_in
from tests.helpers import gateway_for
from tests.redis_server import RedisServer
from tools.fake_vllm import FakeBackend

pytestmark = pytest.mark.slow

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Budgeted:
    """The gateway's listeners and token, and a way to drive it on its own loop."""

    url: str
    admin_url: str
    token: str
    svc: Services
    session: aiohttp.ClientSession
    backends: tuple[FakeBackend, FakeBackend]
    loop: asyncio.AbstractEventLoop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def stats(self) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.token}"}
        r = httpx.get(self.admin_url + "/admin/stats", headers=headers, timeout=5)
        assert r.status_code == 200, r.text
        doc: dict[str, Any] = r.json()
        return doc


@contextmanager
def budgeted_gateway(redis_url: str, prefix: str) -> Iterator[Budgeted]:
    """``tests.budget_and_shed``'s gateway, its limits on ``redis_url``, on an event loop in a
    thread of its own: the browser's side of the test is synchronous."""
    token = "budget-console-token"
    limits = {
        **budget_and_shed.SETTINGS["limits"],
        "store": "redis",
        "redis": {"url": redis_url, "key_prefix": prefix, "timeout": 0.2},
    }
    settings = {**budget_and_shed.SETTINGS, "limits": limits, "admin": {"token": token}}
    started: Future[Budgeted] = Future()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:
        a, b = budget_and_shed.backends()
        try:
            async with gateway_for(a, b, names=budget_and_shed.NAMES, **settings) as (gw, s):
                assert gw.admin_url is not None
                started.set_result(Budgeted(gw.url, gw.admin_url, token, gw.svc, s, (a, b), loop))
                await stop.wait()
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
            raise

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield started.result(60)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


def tile(page: Page, label: str) -> Any:
    return page.locator("#tiles .tile").filter(has_text=label).locator(".value")


def test_the_page_shows_the_retry_budget_its_state_and_the_requests_shed(
    browser: Browser, own_redis: RedisServer, redis_prefix: str
) -> None:
    with budgeted_gateway(own_redis.url, redis_prefix) as gateway:
        a, b = gateway.backends
        statuses = gateway.run(budget_and_shed.retried(gateway.session, gateway.url))
        gateway.run(budget_and_shed.shed_one(gateway.session, gateway.url, gateway.svc, a, b))
        retry = gateway.stats()["retry_budget"]["attempts"]["retry"]
        assert retry["refused"] == statuses[503] >= 1
        assert retry["taken"] >= 1
        with opened(browser, gateway) as page:
            sign_in(page, gateway.token)
            expect(page.locator("#console")).to_be_visible()
            # The admission queue's tile and its outcomes: the one request shed.
            expect(tile(page, "Admission queue")).to_have_text("0 waiting · 0 admitted · 1 shed")
            shed = page.locator('#admission tr[data-key="shed"] td')
            expect(shed.nth(1)).to_have_text("1")
            # Per kind, what the budget took and refused: the admin API's counts.
            expect(page.locator("#retry-budget-block")).to_be_visible()
            cells = page.locator('#retry-budget tr[data-key="retry"] td')
            expect(cells.nth(1)).to_have_text(str(int(retry["taken"])))
            expect(cells.nth(2)).to_have_text(str(int(retry["refused"])))
            expect(cells.nth(2)).to_have_class("warn")
            hedge = page.locator('#retry-budget tr[data-key="hedge"] td')
            expect(hedge.nth(1)).to_have_text("0")
            expect(hedge.nth(2)).to_have_text("0")
            state = page.locator("#retry-budget-state")
            shared = re.compile(r"^Shared by the fleet on Redis\. Used here: \d+ % of what")
            expect(state).to_have_text(shared)
            expect(tile(page, "Retry budget used")).to_have_text(re.compile(r"^\d+ %$"))

            own_redis.pause()
            try:
                # Requests while Redis does not answer: the replica decides alone.
                gateway.run(budget_and_shed.retried(gateway.session, gateway.url, 2))
                expect(state).to_have_text(
                    re.compile(r"^Redis does not answer: this replica's own budget decides"),
                    timeout=15_000,
                )
                expect(state).to_have_class("warn")
                expect(tile(page, "Retry budget used")).to_have_text(
                    re.compile(r"^\d+ % · alone \(Redis out\)$")
                )
            finally:
                own_redis.resume()
            expect(state).to_have_text(shared, timeout=15_000)
            expect(state).not_to_have_class("warn")
