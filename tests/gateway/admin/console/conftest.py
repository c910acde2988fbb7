"""The browser the console's tests drive: one headless Chromium per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Playwright, sync_playwright

from tests.gateway.admin.console.page import chromium_path


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    b = playwright.chromium.launch(
        executable_path=chromium_path(),
        args=["--no-sandbox", "--disable-background-networking", "--no-first-run"],
    )
    yield b
    b.close()
