"""The Grafana dashboard drawn from real data, for docs/img/dashboard.png (Grafana itself cannot
be installed here: ``loadtest.dashboard`` runs the panels' queries and plots them).

The shipped production configuration in front of three simulators (``tests/gateway/admin/console/
fleet.py``), a real Prometheus scraping them every second (``tests/deploy/prometheus_server``),
streaming traffic with an over-limit key, then: a backend drained, the canary moved to 30 %,
a backend killed.

    .venv/bin/python scripts/dashboard_picture.py [--minutes 4] [--out docs/img/dashboard.png]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.dashboard import DASHBOARD, fetch, render  # noqa: E402
from tests.deploy.prometheus_server import running_prometheus  # noqa: E402
from tests.gateway.admin.console.fleet import Traffic, running_fleet  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--minutes", type=float, default=4.0, help="of traffic drawn")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = ap.parse_args()
    seconds = args.minutes * 60
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_fleet(Path(tmp), args.redis, "dashboard-picture:") as fleet,
    ):
        hosts = [b["url"][7:] for b in json.loads(fleet.env["GATEWAY_BACKENDS"])]
        targets = {"gateway": [fleet.url.removeprefix("http://")], "vllm": hosts}
        with running_prometheus(Path(tmp), targets, ROOT / "deploy/prometheus/alerts.yml") as prom:
            started = time.time()
            traffic = Traffic(fleet.url).start(streams=8, over_limit=6)
            events = [
                (0.35, "drain gpu-b", lambda: fleet.admin("POST", "/admin/backends/gpu-b/drain")),
                (
                    0.5,
                    "undrain gpu-b",
                    lambda: fleet.admin("POST", "/admin/backends/gpu-b/undrain"),
                ),
                (
                    0.6,
                    "canary to 30 %",
                    lambda: fleet.admin(
                        "PUT", "/admin/aliases/chat", json={"stable": 70, "canary": 30}
                    ),
                ),
                (0.8, "kill gpu-a", lambda: [s.kill() for s in fleet.sims if s.name == "gpu-a"]),
            ]
            while (elapsed := time.time() - started) < seconds:
                while events and elapsed > events[0][0] * seconds:
                    _, what, act = events.pop(0)
                    act()
                    print(f"{elapsed:5.0f} s: {what}", flush=True)
                time.sleep(1)  # sleep-ok: letting traffic run for the picture
            traffic.stop()
            ended = time.time()
            data = fetch(prom, json.loads(DASHBOARD.read_text()), started, ended)
    title = (
        "LLM gateway dashboard, drawn from Prometheus without Grafana: production configuration, "
        "3 simulators; gpu-b drained at 35-50 %, canary to 30 % at 60 %, gpu-a killed at 80 %"
    )
    render(data, args.out, title, start=started, end=ended)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
