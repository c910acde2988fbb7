"""A screenshot of the operator's console under load, for the README (docs/img/console.png).

Starts two replicas of the gateway (one fleet, on the local Redis) with the shipped production
configuration in front of three simulators (``tests/gateway/admin/console/fleet.py``), streams
through both, makes a key with a budget, drains one backend half-way and shifts the canary
through the second replica, starts a progressive rollout of the canary through it, then
photographs the first one's page in headless Chromium (and its rollouts card alone, beside).

    .venv/bin/python scripts/console_screenshot.py [--seconds 90] [--out docs/img/console.png]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis
from playwright.sync_api import expect, sync_playwright

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.gateway.admin.console.fleet import (  # noqa: E402
    Traffic,
    another_replica,
    running_fleet,
)

# Held at its first step for the picture: a step's hold outlasts the run
ROLLOUT = {
    "stable": "stable",
    "canary": "canary",
    "steps": [5, 25, 50, 100],
    "hold_s": 600,
    "min_requests": 20,
    "gates": {"ttft_p99_factor": 3.0, "itl_p50_factor": 3.0},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=90.0, help="of traffic before the picture")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "console.png")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("no chromium on PATH (make browser installs it)", file=sys.stderr)
        return 1
    prefix = f"console-screenshot:{uuid.uuid4().hex}:"  # its fleet's log starts empty
    with (
        tempfile.TemporaryDirectory() as logs,
        running_fleet(Path(logs), args.redis, prefix) as fleet,
        another_replica(fleet, "replica-b") as second,
        sync_playwright() as pw,
    ):
        traffic = Traffic(fleet.url).start(streams=4, over_limit=6)
        more = Traffic(second.url).start(streams=3, over_limit=0)
        # A key made at run time, with a budget: the keys table and the audit trail show them.
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
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        page.goto(fleet.admin_url + "/")
        page.fill("#token", fleet.token)
        page.click("#sign-in")
        expect(page.locator("#console")).to_be_visible()
        start = time.monotonic()
        drained = shifted = False
        while (elapsed := time.monotonic() - start) < args.seconds:
            if not drained and elapsed > args.seconds / 2:
                second.admin("POST", "/admin/backends/gpu-b/drain")
                drained = True
            if not shifted and elapsed > args.seconds * 0.3:
                second.admin("POST", "/admin/rollouts/chat", json=ROLLOUT)
                shifted = True
            time.sleep(1)  # sleep-ok: letting traffic run for the picture
        page.screenshot(path=str(args.out), full_page=True)
        card = args.out.with_name(args.out.stem + "-rollout" + args.out.suffix)
        page.locator("#rollouts-card").screenshot(path=str(card))
        traffic.stop()
        more.stop()
        browser.close()
    client = redis.Redis.from_url(args.redis)
    stale = list(client.scan_iter(match=prefix + "*"))
    if stale:
        client.delete(*stale)
    client.close()
    print(f"wrote {args.out} and {card}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
