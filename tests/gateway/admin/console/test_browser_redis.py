"""The console in a real headless Chromium while the fleet's Redis is in trouble: a gateway (the
shipped production configuration) on a Redis of the test's own, paused (SIGSTOP), restarted
empty, or its answers held by a proxy after a write landed. The page says what it shows is not
live, which replica's change log is not the fleet's, and what became of a change it made whose
fate the gateway could not tell at once."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Locator, Page, expect

from tests.gateway.admin.console.fleet import running_fleet
from tests.gateway.admin.console.page import apply_in_dialog, opened, signed_in
from tests.redis_proxy import HoldingProxy
from tests.redis_server import RedisServer

pytestmark = pytest.mark.slow

STALE = re.compile(r"^Redis does not answer \(.+\): shown as of (\d+ s|\d+ min.*) ago\.$")


def this_replica(page: Page) -> Locator:
    """The replicas table's cells of the replica whose page this is."""
    return page.locator("#replicas tbody tr").filter(has_text="(this one)").locator("td")


def test_views_answered_from_the_last_state_known_say_so_while_redis_is_paused(
    browser: Browser, tmp_path: Path, own_redis: RedisServer, redis_prefix: str
) -> None:
    """Redis paused: the replicas, the audit trail and the rollouts are marked as of their last
    read (not live), this replica's log is shown unreachable; all live again once it answers."""
    with (
        running_fleet(tmp_path / "logs", own_redis.url, redis_prefix) as fleet,
        opened(browser, fleet) as page,
    ):
        signed_in(page, fleet)
        log = this_replica(page).nth(7)
        expect(log).to_have_text("ok")
        expect(page.locator("#fleet-log")).to_contain_text("change log ok (epoch ")
        marks = [page.locator(f"#{view}-stale") for view in ("replicas", "changes", "rollouts")]
        for mark in marks:
            expect(mark).to_be_hidden()
        own_redis.pause()
        try:
            for mark in marks:
                expect(mark).to_have_text(STALE, timeout=15_000)
            expect(page.locator("#replicas")).to_have_class("stale")
            expect(page.locator("#status")).to_contain_text("Redis does not answer")
            # This replica's own row is as it is now: its follower finds Redis silent.
            expect(log).to_have_text("unreachable", timeout=30_000)
            expect(log).to_have_class("bad")
            expect(page.locator("#fleet-log")).to_contain_text("change log unreachable")
            expect(page.locator("#fleet-log")).to_have_class("bad")
        finally:
            own_redis.resume()
        for mark in marks:
            expect(mark).to_be_hidden(timeout=30_000)
        expect(log).to_have_text("ok", timeout=30_000)
        expect(page.locator("#status")).not_to_contain_text("Redis")


def test_a_lost_log_is_shown_being_healed_then_counted(
    browser: Browser, tmp_path: Path, own_redis: RedisServer, redis_prefix: str
) -> None:
    """Redis restarted empty beneath the replica: its log is shown lost while it is healed (two
    report intervals), then whole again, the loss counted."""
    slow_reports = {"GATEWAY_FLEET__REPORT_INTERVAL": "3", "GATEWAY_FLEET__REPORT_TTL": "9"}
    with (
        running_fleet(tmp_path / "logs", own_redis.url, redis_prefix, slow_reports) as fleet,
        opened(browser, fleet) as page,
    ):
        signed_in(page, fleet)
        log = this_replica(page).nth(7)
        expect(log).to_have_text("ok")
        own_redis.stop()
        own_redis.start()  # no persistence: the log and its epoch are gone
        expect(log).to_have_text("lost: being healed", timeout=20_000)
        expect(log).to_have_class("bad")
        expect(page.locator("#fleet-log")).to_contain_text("change log LOST")
        expect(page.locator("#fleet-log")).to_have_class("bad")
        # Healed by the replica furthest ahead (here, the only one): whole again, the loss said.
        expect(log).to_have_text("ok", timeout=30_000)
        expect(page.locator("#fleet-log")).to_contain_text(
            "found lost 1 time since this replica started"
        )
        expect(page.locator("#fleet-log")).to_have_class("warn")


def test_a_change_refused_while_redis_is_paused_is_tried_again_with_the_same_key(
    browser: Browser, tmp_path: Path, own_redis: RedisServer, redis_prefix: str
) -> None:
    """Redis paused: a drain made on the page is refused (503: certainly not written) or its
    fate is unknown (202) until Redis answers; either way the page says so, and "Try again"
    sends the same change with the same Idempotency-Key, applied once."""
    with (
        running_fleet(tmp_path / "logs", own_redis.url, redis_prefix) as fleet,
        opened(browser, fleet) as page,
    ):
        signed_in(page, fleet)
        banner = page.locator("#banner")
        own_redis.pause()
        try:
            with page.expect_response(lambda r: r.url.endswith("/drain"), timeout=30_000) as first:
                page.locator('#backends tr[data-backend="gpu-b"] button.drain').click()
                apply_in_dialog(page, [("draining", "false", "true")])
            key = first.value.request.headers["idempotency-key"]
            if first.value.status == 503:
                expect(banner).to_contain_text("the change was not written")
            else:
                assert first.value.status == 202
                expect(banner).to_contain_text("may be applied; checking…")
        finally:
            own_redis.resume()
        if first.value.status == 202:  # settled once Redis answers: the page says which
            expect(banner).to_contain_text(re.compile(r"applied\)$|^Not applied"), timeout=30_000)
        if banner.locator("button.again").count():
            with page.expect_request(lambda r: r.url.endswith("/drain")) as again:
                banner.locator("button.again").click()
            assert again.value.headers["idempotency-key"] == key  # the same change
            expect(banner).to_have_text("Drained gpu-b.", timeout=30_000)
        assert fleet.backend("gpu-b")["draining"] is True
        trail = fleet.admin("GET", "/admin/changes?limit=50").json()["changes"]
        assert [c["id"] for c in trail].count(key) == 1  # applied once


@contextmanager
def holding_proxy_thread(port: int) -> Iterator[tuple[HoldingProxy, asyncio.AbstractEventLoop]]:
    """``tests.redis_proxy``'s proxy in front of Redis on ``port``, on a loop of its own (the
    browser's side of the test is synchronous); hold and release it through that loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="redis-proxy", daemon=True)
    thread.start()
    proxy = HoldingProxy(port)
    try:
        asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(10)
        yield proxy, loop
    finally:
        asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_a_change_whose_answer_redis_holds_is_said_unknown_then_followed_to_its_fate(
    browser: Browser, tmp_path: Path, own_redis: RedisServer, redis_prefix: str
) -> None:
    """The write lands, its answer does not come: the gateway answers 202 "unknown"; the page
    says it may be applied and is being checked, asks after its id, and says it applied."""
    fast = {"GATEWAY_FLEET__LOG_TIMEOUT": "1"}
    with (
        holding_proxy_thread(own_redis.port) as (proxy, loop),
        running_fleet(tmp_path / "logs", proxy.url, redis_prefix, fast) as fleet,
        opened(browser, fleet) as page,
    ):
        signed_in(page, fleet)
        loop.call_soon_threadsafe(proxy.hold, b"XADD")  # the writer's answers wait
        try:
            with page.expect_response(lambda r: r.url.endswith("/drain")) as answer:
                page.locator('#backends tr[data-backend="gpu-b"] button.drain').click()
                apply_in_dialog(page, [("draining", "false", "true")])
            assert answer.value.status == 202
            key = answer.value.request.headers["idempotency-key"]
            banner = page.locator("#banner")
            expect(banner).to_have_text(
                f"POST /admin/backends/gpu-b/drain (change {key}): Redis did not answer: "
                "may be applied; checking…"
            )
            expect(banner).to_have_class("banner info")
            # Its id fenced, the log read: applied (the write had landed), said on the page.
            expect(banner).to_have_text(f"Drained gpu-b. (change {key}: applied)", timeout=20_000)
            expect(banner).to_have_class("banner ok")
        finally:
            loop.call_soon_threadsafe(proxy.release)
        assert fleet.backend("gpu-b")["draining"] is True
        ids = page.locator("#changes tbody tr td:nth-child(2)")
        expect(ids.filter(has_text=key)).to_have_count(1)  # applied once
