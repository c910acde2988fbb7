"""The console's page in a real headless Chromium, for the browser tests: the browser found, a
page opened on a gateway's admin listener (and checked when closed: every request it made went
to that listener only, none with the token in its URL, nothing left in the browser's storage),
signing in, the confirmation dialog, a condition polled with a deadline."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Browser, Page, Request, expect

from tests.gateway.admin.console.fleet import Fleet

CHROMIUM_ENV = "LLM_GATEWAY_CHROMIUM"


class Listener(Protocol):
    """A gateway's admin listener and its token: a ``Fleet``, or a gateway run in the test."""

    @property
    def admin_url(self) -> str: ...

    @property
    def token(self) -> str: ...


def chromium_path() -> str:
    found = (
        os.environ.get(CHROMIUM_ENV) or shutil.which("chromium") or shutil.which("chromium-browser")
    )
    if not found:
        pytest.fail(
            "No Chromium for the console's browser tests: `make browser` installs Debian's "
            f"(apt), or set {CHROMIUM_ENV} to a Chromium binary.",
            pytrace=False,
        )
    return found


@contextmanager
def opened(browser: Browser, fleet: Listener) -> Iterator[Page]:
    """The console of ``fleet``'s gateway in a new browser context, checked when closed."""
    context = browser.new_context()
    p = context.new_page()
    requests: list[Request] = []
    p.on("request", lambda r: requests.append(r))  # noqa: PLW0108 - a bound method is refused
    p.goto(fleet.admin_url + "/")
    yield p
    # What the page did, whatever the test: only its own listener, the token in no URL and in
    # no storage it keeps.
    origin = urlsplit(fleet.admin_url).netloc
    assert requests
    assert {urlsplit(r.url).netloc for r in requests} == {origin}
    assert not [r.url for r in requests if fleet.token in r.url]
    assert fleet.token not in p.url
    storage = p.evaluate("() => [localStorage.length, sessionStorage.length, document.cookie]")
    assert storage == [0, 0, ""]
    assert context.cookies() == []
    context.close()


def sign_in(page: Page, token: str) -> None:
    page.fill("#token", token)
    page.click("#sign-in")


def signed_in(page: Page, fleet: Fleet) -> None:
    sign_in(page, fleet.token)
    expect(page.locator("#console")).to_be_visible()
    for backend in ("gpu-a", "gpu-b", "gpu-canary"):
        expect(page.locator(f'#backends tr[data-backend="{backend}"]')).to_be_visible()


def apply_in_dialog(page: Page, expected_rows: list[tuple[str, str, str]]) -> None:
    """The confirmation shows each change as (setting, now, after) before it is applied."""
    dialog = page.locator("#confirm")
    expect(dialog).to_be_visible()
    rows = dialog.locator("#confirm-diff tbody tr")
    expect(rows).to_have_count(len(expected_rows))
    for i, row in enumerate(expected_rows):
        expect(rows.nth(i).locator("td")).to_have_text(list(row))
    page.click("#confirm-apply")
    expect(dialog).to_be_hidden()


def wait_until(condition: Callable[[], object], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)  # sleep-ok: polling a condition with a deadline
