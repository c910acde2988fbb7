"""The console's capacity panel in a real headless Chromium, against a gateway with capacity on
in front of three simulators in vLLM's dev mode: idle engines put to sleep shown asleep, one
woken and put back to sleep from the page (through the admin API, confirmed first), the
manager's figures and the engine-seconds asleep it counted."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from tests.gateway.admin.console.page import apply_in_dialog, opened, sign_in
from tests.helpers import gateway_for
from tools.sim import FAST, RunningSim

pytestmark = pytest.mark.slow

MODEL = "sim-model"
ENGINES = ("engine-a", "engine-b", "engine-c")
WAKE_S = 3.0  # long enough for the page (a poll a second) to show an engine waking


@dataclass(frozen=True, slots=True)
class Capacity:
    """The gateway's listeners and token, for the page and for the test's own admin calls."""

    url: str
    admin_url: str
    token: str

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"}
        return httpx.request(method, self.admin_url + path, headers=headers, timeout=5, **kwargs)

    def states(self) -> dict[str, str]:
        view = self.admin("GET", "/admin/capacity").json()
        return {e["backend"]: e["state"] for e in view["engines"]}


@contextmanager
def capacity_gateway(rule: dict[str, Any]) -> Iterator[Capacity]:
    """The gateway (capacity on, ``rule`` for the simulators' model) on an event loop in a
    thread of its own: the browser's side of the test is synchronous."""
    token = "capacity-console-token"
    capacity = {"enabled": True, "every": 0.05, "sleep_poll": 0.05, "models": {MODEL: rule}}
    started: Future[Capacity] = Future()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:
        config = dataclasses.replace(FAST, dev_mode=True, wake_time=WAKE_S)
        engines = [RunningSim(config) for _ in ENGINES]
        try:
            async with gateway_for(
                *engines, names=ENGINES, capacity=capacity, admin={"token": token}
            ) as (gw, _):
                assert gw.admin_url is not None
                started.set_result(Capacity(gw.url, gw.admin_url, token))
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


def signed_in(page: Page, gateway: Capacity) -> None:
    sign_in(page, gateway.token)
    expect(page.locator("#console")).to_be_visible()
    expect(page.locator("#capacity-card")).to_be_visible()


def engine_row(page: Page, engine: str) -> Any:
    return page.locator(f'#engines tr[data-key="{engine}"]')


# The background of an engine's state pill, as the browser paints it
BACKGROUND = "(e) => getComputedStyle(e).backgroundColor"


def test_the_panel_shows_idle_engines_asleep_and_the_managers_figures(browser: Browser) -> None:
    with (
        capacity_gateway({"min_awake": 1, "idle_before_sleep": 0.1}) as gateway,
        opened(browser, gateway) as page,
    ):
        signed_in(page, gateway)
        engines = page.locator("#engines tbody tr")
        expect(engines).to_have_count(3)
        expect(page.locator('#engines tr[data-state="asleep"]')).to_have_count(2, timeout=30_000)
        expect(page.locator('#engines tr[data-state="awake"]')).to_have_count(1)
        asleep = page.locator("#engines .rest.asleep").first
        awake = page.locator("#engines .rest.awake")
        expect(asleep).to_have_text("asleep")
        expect(awake).to_have_text("awake")
        assert asleep.evaluate(BACKGROUND) != awake.evaluate(BACKGROUND)  # told apart at a glance
        # Which ones, as the admin API says; each one asleep marked in the backends table too.
        states = gateway.states()
        for engine, state in states.items():
            expect(engine_row(page, engine)).to_have_attribute("data-state", state)
            backend = page.locator(f'#backends tr[data-backend="{engine}"] td').first
            if state == "asleep":
                expect(backend.locator(".pill.rest.asleep")).to_have_text("asleep")
            else:
                expect(backend.locator(".pill.rest")).to_have_count(0)
        tiles = page.locator("#capacity-tiles")
        expect(tiles.locator('[data-key="asleep"] .value')).to_have_text("2")
        expect(tiles.locator('[data-key="awake"] .value')).to_have_text("1")
        expect(tiles.locator('[data-key="waking"] .value')).to_have_text("0")
        # The engine-seconds asleep the manager counted (this gateway alone: all of them).
        expect(tiles.locator('[data-key="saved"] .value')).to_have_text(
            re.compile(r"^[1-9][\d,]* engine-s"), timeout=15_000
        )
        expect(page.locator("#capacity-saved-note")).to_contain_text("since this gateway started")
        expect(page.locator("#capacity-summary")).to_contain_text("managed by this gateway")
        # The model's rule and the manager's last turn: one engine needed, and why.
        cells = page.locator(f'#capacity-models tr[data-key="{MODEL}"] td')
        expect(cells.nth(1)).to_have_text("1")  # min awake
        expect(cells.nth(2)).to_have_text("all")  # max awake
        expect(cells.nth(3)).to_have_text("1")  # awake
        expect(cells.nth(6)).to_have_text("1")  # need
        expect(cells.nth(8)).to_have_text("0")  # held
        expect(cells.nth(10)).not_to_have_text("\N{EN DASH}")  # the manager's reason


def test_an_engine_is_woken_and_put_back_to_sleep_from_the_page(browser: Browser) -> None:
    with (
        capacity_gateway({"min_awake": 1, "idle_before_sleep": 0.1}) as gateway,
        opened(browser, gateway) as page,
    ):
        signed_in(page, gateway)
        expect(page.locator('#engines tr[data-state="asleep"]')).to_have_count(2, timeout=30_000)
        # From now on the manager lets an engine woken by hand stay awake.
        rule = gateway.admin("PUT", f"/admin/capacity/{MODEL}", json={"idle_before_sleep": 600})
        assert rule.status_code == 200, rule.text
        engine = next(e for e, state in gateway.states().items() if state == "asleep")
        row = engine_row(page, engine)
        with page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/wake")) as sent:
            row.locator("button.wake").click()
            apply_in_dialog(page, [("sleep wanted", "true", "false")])
        assert sent.value.post_data_json == {"why": "from the console"}
        expect(page.locator("#banner")).to_have_text(f"{engine}: wanted awake.")
        # Waking (its /wake_up takes WAKE_S), then awake and taking requests again.
        expect(row.locator(".rest.waking")).to_have_text("waking", timeout=10_000)
        expect(row).to_have_attribute("data-state", "awake", timeout=30_000)
        expect(page.locator('#capacity-tiles [data-key="awake"] .value')).to_have_text("2")
        assert gateway.states()[engine] == "awake"
        # Back to sleep from the page: the manager puts it to sleep once it is idle.
        row.locator("button.sleep").click()
        apply_in_dialog(page, [("sleep wanted", "false", "true")])
        expect(page.locator("#banner")).to_have_text(f"{engine}: wanted asleep.")
        expect(row).to_have_attribute("data-state", "asleep", timeout=30_000)
        assert gateway.states()[engine] == "asleep"
