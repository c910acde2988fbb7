"""A real Prometheus server for tests (Debian's package: ``make prometheus`` installs it),
listening on 127.0.0.1 only, with its data in a temporary folder."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.procs import free_port


def binary(name: str) -> str:
    found = shutil.which(name)
    assert found is not None, f"{name} is not on PATH: `make prometheus` installs it"
    return found


@contextmanager
def running_prometheus(
    folder: Path, targets: dict[str, list[str]], rules: Path | None = None
) -> Iterator[str]:
    """Prometheus scraping ``targets`` (job -> host:port list) every second and evaluating
    ``rules`` every second; its base URL."""
    config: dict[str, Any] = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": hosts}]}
            for job, hosts in targets.items()
        ],
    }
    if rules is not None:
        config["rule_files"] = [str(rules)]
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (folder / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary("prometheus"),
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (folder / "prometheus.log").read_text()
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus did not get ready in 30 s"
            time.sleep(0.2)  # sleep-ok: polling a starting server
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def instant(url: str, expr: str) -> list[dict[str, Any]]:
    """An instant query's result (a list of series); an error says which query."""
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10)
    doc = r.json()
    assert doc.get("status") == "success", f"{expr}: {doc.get('error')}"
    result: list[dict[str, Any]] = doc["data"]["result"]
    return result
