"""A screenshot of the operator's console under load, for the README (docs/img/console.png).

By default it starts two replicas of the gateway (one fleet, on the local Redis) with the
shipped production configuration in front of three simulators
(``tests/gateway/admin/console/fleet.py``), streams through both, makes a key with a budget,
drains one backend half-way and shifts the canary through the second replica, starts a
progressive rollout of the canary through it, then photographs the first one's page in headless
Chromium (and its rollouts card alone, beside).

With ``--admin URL`` it photographs a running gateway's console instead, as it is: nothing is
started and nothing changed; the token comes from ``--token`` or ``GATEWAY_ADMIN__TOKEN``.

    .venv/bin/python scripts/console_screenshot.py [--seconds 90] [--out docs/img/console.png]
    .venv/bin/python scripts/console_screenshot.py --admin http://127.0.0.1:8081 [--token T]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import redis
from playwright.sync_api import Error, Playwright, expect, sync_playwright

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.gateway.admin.console.fleet import (  # noqa: E402
    Traffic,
    another_replica,
    running_fleet,
)

TOKEN_ENV = "GATEWAY_ADMIN__TOKEN"  # the gateway's own (admin.token)
CHROMIUM_ENV = "LLM_GATEWAY_CHROMIUM"  # as the console's browser tests name one
VIEWPORT = {"width": 1500, "height": 1000}

# Held at its first step for the picture: a step's hold outlasts the run
ROLLOUT = {
    "stable": "stable",
    "canary": "canary",
    "steps": [5, 25, 50, 100],
    "hold_s": 600,
    "min_requests": 20,
    "gates": {"ttft_p99_factor": 3.0, "itl_p50_factor": 3.0},
}


class Refused(Exception):
    """The console did not sign in (a wrong token, or no admin API at that address)."""


def photograph(
    pw: Playwright,
    chromium: str,
    admin_url: str,
    token: str,
    *,
    seconds: float,
    out: Path,
    each_second: Callable[[float], None] = lambda _elapsed: None,
) -> Path:
    """Sign in to the console at ``admin_url``, let it poll for ``seconds`` (calling
    ``each_second`` with the time elapsed), then write the page to ``out`` and its rollouts
    card beside it; the card's path."""
    browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
    try:
        page = browser.new_page(viewport=VIEWPORT)
        page.goto(admin_url + "/")
        page.fill("#token", token)
        page.click("#sign-in")
        page.locator("#console:visible, #login-error:visible").first.wait_for()
        if page.locator("#login-error").is_visible():
            raise Refused(page.locator("#login-error").inner_text())
        expect(page.locator("#status")).to_contain_text("live")  # one poll rendered
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < seconds:
            each_second(elapsed)
            time.sleep(1)  # sleep-ok: letting the page poll and its charts fill for the picture
        page.screenshot(path=str(out), full_page=True)
        card = out.with_name(out.stem + "-rollout" + out.suffix)
        page.locator("#rollouts-card").screenshot(path=str(card))
        return card
    finally:
        browser.close()


def staged(pw: Playwright, chromium: str, args: argparse.Namespace) -> Path:
    """The README's picture: a fleet of two started here, under traffic and changes."""
    prefix = f"console-screenshot:{uuid.uuid4().hex}:"  # its fleet's log starts empty
    try:
        with (
            tempfile.TemporaryDirectory() as logs,
            running_fleet(Path(logs), args.redis, prefix) as fleet,
            another_replica(fleet, "replica-b") as second,
        ):
            traffic = Traffic(fleet.url).start(streams=4, over_limit=6)
            more = Traffic(second.url).start(streams=3, over_limit=0)
            # A key made at run time, with a budget: the keys table and the audit trail show it.
            fleet.admin(
                "POST",
                "/admin/keys",
                json={"name": "team-a", "tier": "interactive", "labels": {"team": "search"}},
            )
            fleet.admin(
                "PUT",
                "/admin/keys/team-a/budget",
                json={"tokens_per_day": 1_000_000, "tokens_per_month": 20_000_000},
            )
            done: set[str] = set()

            def stage(elapsed: float) -> None:
                if "rollout" not in done and elapsed > args.seconds * 0.3:
                    second.admin("POST", "/admin/rollouts/chat", json=ROLLOUT)
                    done.add("rollout")
                if "drain" not in done and elapsed > args.seconds / 2:
                    second.admin("POST", "/admin/backends/gpu-b/drain")
                    done.add("drain")

            try:
                return photograph(
                    pw,
                    chromium,
                    fleet.admin_url,
                    fleet.token,
                    seconds=args.seconds,
                    out=args.out,
                    each_second=stage,
                )
            finally:
                traffic.stop()
                more.stop()
    finally:
        client = redis.Redis.from_url(args.redis)
        stale = list(client.scan_iter(match=prefix + "*"))
        if stale:
            client.delete(*stale)
        client.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--seconds",
        type=float,
        help="of polling before the picture (default 90 for the fleet started here, "
        "10 for a running gateway's console)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "console.png")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="for the fleet started")
    ap.add_argument(
        "--admin",
        metavar="URL",
        help="a running gateway's admin API (e.g. http://127.0.0.1:8081): photograph its "
        "console as it is, starting and changing nothing",
    )
    ap.add_argument("--token", help=f"with --admin, its admin token (default: ${TOKEN_ENV})")
    args = ap.parse_args()
    chromium = (
        os.environ.get(CHROMIUM_ENV) or shutil.which("chromium") or shutil.which("chromium-browser")
    )
    if chromium is None:
        print(
            f"no chromium on PATH (make browser installs it; or set {CHROMIUM_ENV})",
            file=sys.stderr,
        )
        return 1
    token = args.token or os.environ.get(TOKEN_ENV)
    if args.admin is not None and not token:
        print(f"--admin needs the admin token: --token, or set {TOKEN_ENV}", file=sys.stderr)
        return 2
    if args.seconds is None:
        args.seconds = 90.0 if args.admin is None else 10.0
    with sync_playwright() as pw:
        try:
            if args.admin is None:
                card = staged(pw, chromium, args)
            else:
                assert token is not None
                card = photograph(
                    pw, chromium, args.admin.rstrip("/"), token, seconds=args.seconds, out=args.out
                )
        except Refused as exc:
            print(f"{args.admin}: {exc}", file=sys.stderr)
            return 2
        except Error as exc:  # no console at that address
            if args.admin is None:
                raise
            print(f"{args.admin}: {exc.message.splitlines()[0]}", file=sys.stderr)
            return 1
    print(f"wrote {args.out} and {card}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
