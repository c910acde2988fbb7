"""The alert rules and the Grafana dashboard, checked with Prometheus' own tools and run
against a real Prometheus scraping a real gateway (the shipped production configuration) and
its simulators: every panel's query and every alert's expression names metrics that exist and
returns data, and an alert fires when its condition is made true (a backend killed; the fleet's
Redis restarted empty)."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loadtest.dashboard import DASHBOARD, expand, fetch, panels, render
from tests.deploy.prometheus_server import binary, instant, running_prometheus
from tests.gateway.admin.console.fleet import KEYS, MODEL, Fleet, Traffic, running_fleet
from tests.redis_server import RedisServer

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
ALERTS = PROMETHEUS / "alerts.yml"
RATE = "10s"  # $__rate_interval at a 1 s scrape interval
METRIC = re.compile(r"\b(llm_gateway_[a-z_]+|inference_queue_depth|up)\b(?!\s*\()")
KILLED = "gpu-b"


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def quick_rules(folder: Path) -> Path:
    """The alert rules with their ``for`` shortened to 2 s (their timing is what the promtool
    unit tests check), written in ``folder``."""
    rules = folder / "alerts.yml"
    rules.write_text(re.sub(r"for: \S+", "for: 2s", ALERTS.read_text()))
    return rules


def firing(prometheus: str, name: str) -> list[dict[str, Any]]:
    doc = httpx.get(prometheus + "/api/v1/alerts", timeout=10).json()
    return [
        a
        for a in doc["data"]["alerts"]
        if a["labels"]["alertname"] == name and a["state"] == "firing"
    ]


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def queries() -> list[tuple[str, str]]:
    """(panel title, query) of every panel."""
    return [(p.title, expr) for p in panels(dashboard()) for expr, _ in p.queries]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *args], capture_output=True, text=True, timeout=60, check=False
    )


# -- static checks -------------------------------------------------------------------------


@pytest.mark.prometheus
def test_promtool_accepts_the_rules_and_the_compose_prometheus_config(tmp_path: Path) -> None:
    rules = promtool("check", "rules", str(ALERTS))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in rules.stdout
    # compose mounts the rules at /etc/prometheus/alerts.yml: here, the repository's file.
    config = (PROMETHEUS / "prometheus.yml").read_text()
    config = config.replace("/etc/prometheus/alerts.yml", str(ALERTS))
    (tmp_path / "prometheus.yml").write_text(config)
    checked = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.prometheus
def test_promtool_unit_tests_of_every_alert_pass() -> None:
    """deploy/prometheus/alerts_test.yml: each alert fires on its condition held for its
    ``for``, not before, and not on the healthy series beside it."""
    done = promtool("test", "rules", str(PROMETHEUS / "alerts_test.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    tested = set(re.findall(r"alertname: (\w+)", (PROMETHEUS / "alerts_test.yml").read_text()))
    assert tested == {r["alert"] for r in alert_rules()}


def test_the_kubernetes_prometheusrule_holds_the_same_rules() -> None:
    doc = yaml.safe_load((PROMETHEUS / "prometheusrule.yaml").read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert doc["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]


def test_the_dashboard_is_importable_and_provisioned() -> None:
    doc = dashboard()
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    # Importable by hand: the data source is a variable, not this installation's uid.
    [variable] = doc["templating"]["list"]
    assert (variable["type"], variable["query"]) == ("datasource", "prometheus")
    for p in doc["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
    titles = " ".join(p["title"].lower() for p in doc["panels"])
    for watched in (
        "requests by backend and status",
        "errors",
        "time to first token",
        "inter-token latency",
        "in flight",
        "queue",
        "admission",
        "rate-limit rejections",
        "circuit",
        "health",
        "prefix-affinity",
        "canary",
    ):
        assert watched in titles, watched
    compose = yaml.safe_load((PROMETHEUS.parents[1] / "compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(m.startswith("./deploy/grafana/llm-gateway.json:") for m in mounts)


# -- against a real Prometheus ---------------------------------------------------------------


@dataclass
class Observed:
    prometheus: str
    fleet: Fleet
    started: float
    killed_at: float


def sim_hosts(fleet: Fleet) -> dict[str, str]:
    """Backend name -> host:port of the fleet's simulators."""
    return {b["name"]: b["url"][7:] for b in json.loads(fleet.env["GATEWAY_BACKENDS"])}


def leave_mid_stream(url: str, stop: threading.Event) -> None:
    """A client that goes away after the first chunk, now and then: the upstream aborts."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long answer please"}],
        "stream": True,
        "max_tokens": 200,
    }
    headers = {"Authorization": f"Bearer {KEYS['web-app']}"}
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers):
                pass  # headers read, then closed: the stream is cut
            stop.wait(1.0)


def streams_on(fleet: Fleet, backend: str, within: float = 10.0) -> None:
    """Wait until the gateway has a request in flight on ``backend`` (at most ``within`` s:
    then it goes on, and the panels that need a broken stream say so)."""
    deadline = time.monotonic() + within
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            r = client.get(fleet.admin_url + "/admin/backends", headers=fleet.admin_headers)
            if any(b["id"] == backend and b["in_flight"] > 0 for b in r.json()["backends"]):
                return
            time.sleep(0.01)  # sleep-ok: polling another process, with a deadline


def seen_down(prometheus: str, backend: str, within: float = 60.0) -> None:
    """Wait until Prometheus has scraped the gateway's word that ``backend`` is down (the
    health probes' failures counted, then a scrape: how long depends on the machine)."""
    deadline = time.monotonic() + within
    while not instant(prometheus, f'llm_gateway_backend_up{{backend="{backend}"}} == 0'):
        assert time.monotonic() < deadline, f"{backend} not seen down within {within} s"
        time.sleep(0.2)  # sleep-ok: polling another process, with a deadline


@pytest.fixture(scope="module")
def observed(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, module_redis_prefix: str
) -> Iterator[Observed]:
    """The production configuration under traffic for ~20 s, scraped every second, one
    backend killed two thirds of the way; the alert rules evaluated with their ``for``
    shortened to 2 s (their timing is what the promtool unit tests above check)."""
    folder = tmp_path_factory.mktemp("monitoring")
    rules = quick_rules(folder)
    # Capacity managed (its alerts' series exported); the simulators are not in dev mode, so
    # none is put to sleep: the traffic's figures stay those of an always-awake fleet
    capacity = {
        "GATEWAY_CAPACITY__ENABLED": "true",
        "GATEWAY_CAPACITY__MODELS": json.dumps({MODEL: {"min_awake": 1}}),
    }
    with running_fleet(folder, redis_url, module_redis_prefix, capacity) as fleet:
        gateway = fleet.url.removeprefix("http://")
        targets = {"gateway": [gateway], "vllm": list(sim_hosts(fleet).values())}
        with running_prometheus(folder, targets, rules) as prometheus:
            started = time.time()
            traffic = Traffic(fleet.url).start(streams=6, over_limit=6)
            stop = threading.Event()
            leaver = threading.Thread(target=leave_mid_stream, args=(fleet.url, stop))
            leaver.start()
            time.sleep(14)  # sleep-ok: traffic for the panels to show
            [victim] = [s for s in fleet.sims if s.name == KILLED]
            streams_on(fleet, KILLED)  # so that a stream breaks, and is continued elsewhere
            victim.kill()
            killed_at = time.time()
            seen_down(prometheus, KILLED)
            time.sleep(4)  # sleep-ok: traffic goes on without the killed backend
            stop.set()
            traffic.stop()
            leaver.join(30)
            yield Observed(prometheus, fleet, started, killed_at)


@pytest.mark.prometheus
def test_every_dashboard_query_returns_data(observed: Observed) -> None:
    empty = [
        f"{title}: {expr}"
        for title, expr in queries()
        if not instant(observed.prometheus, expand(expr, RATE))
    ]
    assert empty == []


@pytest.mark.prometheus
def test_every_metric_an_alert_or_a_panel_names_exists(observed: Observed) -> None:
    """A typo'd metric name makes an alert that never fires: every name must be scraped."""
    r = httpx.get(observed.prometheus + "/api/v1/label/__name__/values", timeout=10)
    scraped = set(r.json()["data"])
    named = {m for _, expr in queries() for m in METRIC.findall(expr)}
    named |= {m for rule in alert_rules() for m in METRIC.findall(rule["expr"])}
    assert len(named) > 20
    assert named - scraped == set()


@pytest.mark.prometheus
def test_every_alert_expression_evaluates(observed: Observed) -> None:
    """Each expression runs (no syntax Prometheus refuses); those whose condition the run
    made true return series, the others none."""
    fires = {}
    for rule in alert_rules():
        fires[rule["alert"]] = bool(instant(observed.prometheus, rule["expr"]))
    assert fires["LLMGatewayBackendDown"]
    assert not fires["LLMGatewayDown"]
    assert not fires["LLMGatewayNoRoutableBackend"]
    assert not fires["LLMGatewayLimitsDegraded"]
    for fleet_log in ("FleetLogLost", "FleetLogWasLost", "FleetChangesUnknown"):
        assert not fires[f"LLMGateway{fleet_log}"]


@pytest.mark.prometheus
def test_backend_down_fires_for_the_killed_backend(observed: Observed) -> None:
    deadline = time.monotonic() + 30
    while not firing(observed.prometheus, "LLMGatewayBackendDown"):
        assert time.monotonic() < deadline, "LLMGatewayBackendDown never fired"
        time.sleep(0.5)  # sleep-ok: Prometheus evaluates the rules every second
    [alert] = firing(observed.prometheus, "LLMGatewayBackendDown")
    assert alert["labels"]["backend"] == KILLED
    assert alert["annotations"]["summary"] == f"Backend {KILLED} fails its health probes"


@pytest.mark.prometheus
def test_the_dashboard_renders_every_panel_with_data(observed: Observed, tmp_path: Path) -> None:
    ended = time.time()
    data = fetch(observed.prometheus, dashboard(), observed.started, ended, rate_interval=RATE)
    blank = [p.title for p, series in data if p.kind != "row" and not series]
    assert blank == []
    out = tmp_path / "dashboard.png"
    render(data, out, "test", start=observed.started, end=ended)
    assert out.stat().st_size > 50_000  # a picture of 23 panels, not an empty canvas


@pytest.mark.prometheus
def test_a_redis_restarted_empty_fires_the_lost_log_alert(
    tmp_path: Path, own_redis: RedisServer, redis_prefix: str
) -> None:
    """The gateway on a Redis of the test's own, restarted without its data: the replica
    finds its change log lost and heals it; the loss it counted fires the alert that says so
    (the log is whole again within seconds, so not the one for a log still lost)."""
    with running_fleet(tmp_path / "logs", own_redis.url, redis_prefix) as fleet:
        targets = {"gateway": [fleet.url.removeprefix("http://")]}
        with running_prometheus(tmp_path, targets, quick_rules(tmp_path)) as prometheus:
            deadline = time.monotonic() + 30
            while not instant(prometheus, 'llm_gateway_fleet_log_state{state="ok"} == 1'):
                assert time.monotonic() < deadline, "the fleet's log never scraped ok"
                time.sleep(0.2)  # sleep-ok: polling another process, with a deadline
            assert firing(prometheus, "LLMGatewayFleetLogWasLost") == []
            own_redis.stop()
            own_redis.start()  # no persistence: the log and its epoch are gone
            deadline = time.monotonic() + 60
            while not firing(prometheus, "LLMGatewayFleetLogWasLost"):
                assert time.monotonic() < deadline, "LLMGatewayFleetLogWasLost never fired"
                time.sleep(0.5)  # sleep-ok: Prometheus evaluates the rules every second
            [alert] = firing(prometheus, "LLMGatewayFleetLogWasLost")
            assert alert["labels"] == {
                "alertname": "LLMGatewayFleetLogWasLost",
                "job": "gateway",
                "severity": "warning",
            }
            [losses] = instant(prometheus, "llm_gateway_fleet_log_losses_total")
            assert losses["value"][1] == "1"
            assert firing(prometheus, "LLMGatewayFleetChangesUnknown") == []
