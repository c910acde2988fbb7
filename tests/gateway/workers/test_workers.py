"""``llm-gateway serve --workers 2``, run for real (a supervisor and two forked workers on one
port) in front of simulators: the host's in-flight view is exact across workers, an admin
change reaches every worker, SIGTERM drains them all, a killed worker is replaced with its
counts cleared, and what cannot be shared is refused at start."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backends.shared_inflight import SLOTS, SharedInFlight, table_bytes
from gateway.observe.host_metrics import REPORTING_METRIC, combine
from gateway.observe.metrics import (
    ADMISSION_QUEUE_METRIC,
    FLEET_ENGINE_QUEUE_METRIC,
    QUEUE_DEPTH_METRIC,
)
from tests.waiting import wait_for
from tools.fake_vllm import FakeBackend, running_fake
from tools.sim import FAST
from tools.sim.testing import RunningSim, running_sim

TOKEN = "workers-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Streams of 60 tokens at 25 ms a step: 1.5 s each, long enough to hold open.
SLOW = FAST.replace(step_base_ms=25.0)
CHAT = {
    "model": "sim-model",
    "messages": [{"role": "user", "content": "hold on"}],
    "max_tokens": 60,
    "ignore_eos": True,
    "stream": True,
}


class Workers:
    """A running ``serve --workers`` process and what it logged (JSON lines on stderr)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.logs: list[dict[str, Any]] = []
        self.garbled: list[bytes] = []  # lines that were not JSON (said when a wait fails)
        self.url = self.admin_url = ""
        self.sockets: dict[int, str] = {}  # worker index -> its private admin socket

    async def read_logs(self) -> None:
        assert self.proc.stderr is not None
        async for line in self.proc.stderr:
            try:
                self.logs.append(json.loads(line))
            except ValueError:
                self.garbled.append(line)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.logs if e.get("event") == name]

    async def started(self, count: int) -> None:
        def up() -> bool:
            if self.proc.returncode is not None:
                return True  # said below
            return len(self.events("gateway_listening")) >= count

        try:
            await wait_for(up, within=30, what="listening")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}; it logged: {self.logs[-20:]}, and not as JSON: {self.garbled[-5:]}"
            ) from None
        assert self.proc.returncode is None, f"it exited: {self.logs[-20:]}"
        for e in self.events("gateway_listening"):
            if e["worker"] == 0:
                self.url, self.admin_url = e["address"], e["admin"]
            else:
                self.sockets[e["worker"]] = e["admin"]

    def pids(self) -> dict[int, int]:
        """Worker index -> pid, as last started."""
        out = dict(enumerate(self.events("workers_started")[0]["pids"]))
        for e in self.events("worker_restarted"):
            out[e["worker"]] = e["pid"]
        return out


@asynccontextmanager
async def workers(
    sims: Sequence[RunningSim | FakeBackend], *args: str, **env: str
) -> AsyncIterator[Workers]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    base |= {
        "GATEWAY_BACKENDS": ",".join(s.url for s in sims),
        "GATEWAY_LOG_FORMAT": "json",
        "GATEWAY_ADMIN__TOKEN": TOKEN,
        "GATEWAY_ADMIN__PORT": "0",
        "GATEWAY_SCRAPE__INTERVAL": "0.1",
        "GATEWAY_HEALTH__INTERVAL": "0.1",
        "GATEWAY_SHUTDOWN_GRACE": "10",
        # An admin answer waits for every worker, however slow the host.
        "GATEWAY_FLEET__WAIT": "15",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "serve",
        "--port",
        "0",
        "--workers",
        "2",
        *args,
        env=base | env,
        stderr=asyncio.subprocess.PIPE,
    )
    w = Workers(proc)
    reader = asyncio.create_task(w.read_logs())
    try:
        await w.started(2)
        yield w
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        await asyncio.wait_for(reader, 5)


async def backends(s: aiohttp.ClientSession, w: Workers) -> dict[str, dict[str, Any]]:
    async with s.get(w.admin_url + "/admin/backends", headers=AUTH) as r:
        assert r.status == 200
        return {b["id"]: b for b in (await r.json())["backends"]}


async def settled(s: aiohttp.ClientSession, w: Workers, backend: str) -> int:
    """The backend's in-flight count once it has stopped changing (at most 5 s)."""
    last = -1
    for _ in range(50):
        now = (await backends(s, w))[backend]["in_flight"]
        if now == last == 0:
            return 0
        last = now
        await asyncio.sleep(0.1)  # sleep-ok: polling interval of a deadline-bounded wait
    return last


class Streams:
    """``n`` streams, each on its own connection (the kernel spreads connections over the
    workers), read to their first chunk and held open."""

    def __init__(self, url: str, n: int) -> None:
        self.url, self.n = url, n
        self.sessions: list[aiohttp.ClientSession] = []
        self.responses: list[aiohttp.ClientResponse] = []

    async def __aenter__(self) -> Streams:
        for _ in range(self.n):
            s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
            self.sessions.append(s)
            r = await s.post(self.url + "/v1/chat/completions", json=CHAT)
            assert r.status == 200
            await r.content.readline()
            self.responses.append(r)
        return self

    async def finish(self) -> list[bytes | BaseException]:
        async def rest(r: aiohttp.ClientResponse) -> bytes:
            return await r.read()

        return await asyncio.gather(*(rest(r) for r in self.responses), return_exceptions=True)

    async def __aexit__(self, *exc: object) -> None:
        for r in self.responses:
            r.release()
        for s in self.sessions:
            await s.close()


async def test_in_flight_counts_are_the_hosts_across_workers() -> None:
    async with running_sim(SLOW) as sim, workers([sim]) as w, aiohttp.ClientSession() as s:
        async with Streams(w.url, 12) as streams:
            view = await backends(s, w)
            assert view[sim.url[7:]]["in_flight"] == 12  # worker 0 sees the other's too
            bodies = await streams.finish()
        assert all(isinstance(b, bytes) and b.endswith(b"data: [DONE]\n\n") for b in bodies)
        await wait_for(lambda: len(w.events("request")) == 12, what="requests logged")
        served_by = {e["worker"] for e in w.events("request")}
        assert served_by == {0, 1}, "the kernel gave every connection to one worker"
        assert await settled(s, w, sim.url[7:]) == 0


async def test_an_admin_change_reaches_every_worker_and_a_refused_one_none() -> None:
    async with running_sim(FAST) as sim, workers([sim]) as w, aiohttp.ClientSession() as s:
        change = {"policy": "least_load", "weights": {"active": 5, "queue": 1, "kv": 0}}
        async with s.put(w.admin_url + "/admin/policy", json=change, headers=AUTH) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-Gateway-Replicas"] == "2/2"
        async with s.put(
            w.admin_url + "/admin/policy", json={"policy": "psychic"}, headers=AUTH
        ) as r:
            assert r.status == 400
            assert "X-Gateway-Replicas" not in r.headers  # refused before the log
        connector = aiohttp.UnixConnector(path=w.sockets[1])
        async with (
            aiohttp.ClientSession(connector=connector) as other,
            other.get("http://worker/admin/policy", headers=AUTH) as r,
        ):
            doc = await r.json()
        assert doc["policy"] == "least_load"
        assert doc["weights"]["active"] == 5
        assert len(w.events("policy_changed")) == 2  # once in each worker, the bad one nowhere
        async with s.post(w.admin_url + f"/admin/backends/{sim.url[7:]}/drain", headers=AUTH) as r:
            assert r.headers["X-Gateway-Replicas"] == "2/2"
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=w.sockets[1])) as other,
            other.get("http://worker/admin/backends", headers=AUTH) as r,
        ):
            assert (await r.json())["backends"][0]["draining"] is True


async def test_sigterm_drains_every_worker() -> None:
    async with running_sim(SLOW) as sim, workers([sim]) as w:
        async with Streams(w.url, 8) as streams:
            w.proc.send_signal(signal.SIGTERM)
            bodies = await streams.finish()
        code = await asyncio.wait_for(w.proc.wait(), 20)
        assert all(isinstance(b, bytes) and b.endswith(b"data: [DONE]\n\n") for b in bodies)
        assert code == 0
        assert {e["worker"] for e in w.events("gateway_stopped")} == {0, 1}
        assert {e["worker"] for e in w.events("request")} == {0, 1}


async def test_a_killed_worker_is_replaced_and_its_counts_cleared() -> None:
    async with running_sim(SLOW) as sim, workers([sim]) as w, aiohttp.ClientSession() as s:
        old = w.pids()
        async with Streams(w.url, 10) as streams:
            os.kill(old[1], signal.SIGKILL)
            bodies = await streams.finish()
            cut = sum(isinstance(b, BaseException) for b in bodies)
            assert 0 < cut < 10, bodies  # worker 1's streams died with it, worker 0's did not
            await wait_for(lambda: w.events("worker_restarted"), what="worker 1 replaced")
        assert w.pids()[1] != old[1]
        assert w.pids()[0] == old[0]
        await wait_for(lambda: len(w.events("gateway_listening")) == 3, what="it listens")
        assert await settled(s, w, sim.url[7:]) == 0  # the dead worker's row cleared
        fast = dict(CHAT, stream=False, max_tokens=2)
        for _ in range(20):  # both workers answer again
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as one,
                one.post(w.url + "/v1/chat/completions", json=fast) as r,
            ):
                assert r.status == 200
        restarted = [e for e in w.events("request") if e["worker"] == 1][-1]
        assert restarted["status"] == 200


async def monitor_reads(s: aiohttp.ClientSession, w: Workers) -> dict[tuple[str, str], float]:
    async with s.get(w.url + "/metrics") as r:
        text = await r.text()
    return {
        (m.labels["read"], m.labels["source"]): m.value
        for f in text_string_to_metric_families(text)
        if f.name == "llm_gateway_monitor_reads"
        for m in f.samples
        if m.name.endswith("_total")
    }


async def test_each_backend_is_read_once_per_host_not_once_per_worker() -> None:
    interval = {"GATEWAY_SCRAPE__INTERVAL": "0.2", "GATEWAY_HEALTH__INTERVAL": "0.2"}
    async with (
        running_fake(FakeBackend()) as fake,
        workers([fake], **interval) as w,
        aiohttp.ClientSession() as s,
    ):
        await asyncio.sleep(1.0)  # sleep-ok: past the first round, which each worker reads
        before, scrapes, probes = await monitor_reads(s, w), fake.scrapes, len(fake.probes)
        await asyncio.sleep(3.0)  # sleep-ok: a window of 15 intervals
        after = await monitor_reads(s, w)
        read = {k: after[k] - before.get(k, 0.0) for k in after}
        # Each worker asks once an interval; worker 0 asks the backend, worker 1 worker 0.
        for kind in ("health", "metrics"):
            ours, shared = read[(kind, "backend")], read[(kind, "worker0")]
            assert shared >= 5, read
            assert ours <= 0.7 * (ours + shared), read  # 0.5 when shared, 1.0 when not
        assert fake.scrapes - scrapes == pytest.approx(read[("metrics", "backend")], abs=3)
        assert len(fake.probes) - probes == pytest.approx(read[("health", "backend")], abs=3)
        # A backend's failing health reaches both workers through worker 0's readings.
        fake.health_status = 503
        connector = aiohttp.UnixConnector(path=w.sockets[1])
        async with aiohttp.ClientSession(connector=connector) as other:

            async def state() -> str:
                async with other.get("http://worker/admin/backends", headers=AUTH) as r:
                    return str((await r.json())["backends"][0]["health"])

            for _ in range(50):
                if await state() == "down":
                    break
                await asyncio.sleep(0.1)  # sleep-ok: polling interval of a deadline-bounded wait
            assert await state() == "down"


def listening(w: Workers, index: int) -> list[dict[str, Any]]:
    return [e for e in w.events("gateway_listening") if e["worker"] == index]


async def policy_of(socket: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket)) as other,
        other.get("http://worker/admin/policy", headers=AUTH) as r,
    ):
        doc: dict[str, Any] = await r.json()
        return doc


async def test_a_worker_started_again_applies_the_change_log_before_traffic(
    tmp_path: Path,
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text("[weights]\nactive = 2\n")
    async with (
        running_sim(FAST) as sim,
        workers([sim], "--config", str(config)) as w,
        aiohttp.ClientSession() as s,
    ):
        change = {"policy": "least_load", "weights": {"active": 5, "queue": 1, "kv": 0}}
        async with s.put(w.admin_url + "/admin/policy", json=change, headers=AUTH) as r:
            assert r.headers["X-Gateway-Replicas"] == "2/2"
        async with s.post(w.admin_url + f"/admin/backends/{sim.url[7:]}/drain", headers=AUTH) as r:
            assert r.headers["X-Gateway-Replicas"] == "2/2"
        # The file changed, then SIGHUP: a reload, itself a change in the log. A worker started
        # again starts from the configuration the workers started with, so it must apply the
        # reload in its place after the change to 5 to end at 3 as the others.
        config.write_text("[weights]\nactive = 3\n")
        w.proc.send_signal(signal.SIGHUP)
        await wait_for(lambda: len(w.events("config_reloaded")) == 2, what="both reloaded")
        assert {e["worker"] for e in w.events("config_reloaded")} == {0, 1}
        configured = (await policy_of(w.sockets[1]))["weights"]["active"]
        assert configured == 3
        os.kill(w.pids()[1], signal.SIGKILL)
        await wait_for(lambda: len(w.events("fleet_joined")) == 3, what="worker 1 joined again")
        caught = w.events("fleet_joined")[-1]
        assert (caught["worker"], caught["applied"]) == (1, 3)
        await wait_for(lambda: len(listening(w, 1)) == 2, what="worker 1 listens again")
        assert w.logs.index(caught) < w.logs.index(listening(w, 1)[1])  # before it takes traffic
        assert (await policy_of(w.sockets[1]))["weights"]["active"] == configured
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=w.sockets[1])) as other,
            other.get("http://worker/admin/backends", headers=AUTH) as r,
        ):
            assert (await r.json())["backends"][0]["draining"] is True
        # Worker 0 too: the log outlives any worker, and its next change comes after them.
        os.kill(w.pids()[0], signal.SIGKILL)
        await wait_for(lambda: len(w.events("fleet_joined")) == 4, what="worker 0 joined again")
        assert w.events("fleet_joined")[-1]["applied"] == 3
        await wait_for(lambda: len(listening(w, 0)) == 2, what="worker 0 listens again")
        admin = listening(w, 0)[-1]["admin"]
        async with s.get(admin + "/admin/backends", headers=AUTH) as r:
            assert (await r.json())["backends"][0]["draining"] is True
        change["weights"] = {"active": 9, "queue": 1, "kv": 0}
        async with s.put(admin + "/admin/policy", json=change, headers=AUTH) as r:
            assert r.headers["X-Gateway-Replicas"] == "2/2"
        assert (await policy_of(w.sockets[1]))["weights"]["active"] == 9


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GATEWAY_LIMITS__TIERS": '{"default": {"requests_per_minute": 5}}'}, "limits.store"),
        ({"GATEWAY_WORKERS": "0"}, "workers must be at least 1"),
        ({"GATEWAY_FLEET__LOG": "off", "GATEWAY_ADMIN__TOKEN": TOKEN}, "in one worker only"),
        ({"GATEWAY_FLEET__LOG": "files", "GATEWAY_WORKERS": "1"}, "needs fleet.dir"),
    ],
)
async def test_what_cannot_be_shared_is_refused_at_start(env: dict[str, str], message: str) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    base |= {"GATEWAY_BACKENDS": "http://127.0.0.1:9", "GATEWAY_WORKERS": "2"} | env
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--port", "0",
        env=base, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert message in err.decode()


async def test_a_port_in_use_is_said_once_not_retried() -> None:
    async with running_sim(FAST) as sim:
        port = sim.url.rsplit(":", 1)[1]  # the simulator's, taken without SO_REUSEPORT
        base = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        base |= {"GATEWAY_BACKENDS": sim.url}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--port", port, "--workers", "2",
            env=base, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert "cannot listen" in err.decode()


def test_the_table_sums_other_rows_and_forgets_a_cleared_one() -> None:
    buf = memoryview(bytearray(table_bytes(3)))
    rows = [SharedInFlight(buf, 3, i) for i in range(3)]
    rows[0].set("a", 2)
    rows[1].set("a", 5)
    rows[2].set("b", 1)
    assert rows[0].others("a") == 5
    assert rows[1].others("a") == 2
    assert rows[2].others("a") == 7
    assert rows[0].others("b") == 1
    assert rows[0].others("nobody") == 0
    rows[1].set("a", 3)
    assert rows[0].others("a") == 3
    rows[0].clear_row(1)  # worker 1 died
    assert rows[0].others("a") == 0
    rows[1] = SharedInFlight(buf, 3, 1)  # its replacement
    rows[1].set("b", 4)
    rows[1].set("a", 1)
    assert rows[0].others("a") == 1
    assert rows[0].others("b") == 5


def test_a_full_row_counts_no_further_backends_and_says_so() -> None:
    buf = memoryview(bytearray(table_bytes(2)))
    mine, other = SharedInFlight(buf, 2, 0), SharedInFlight(buf, 2, 1)
    for i in range(SLOTS):
        mine.set(f"b{i}", 1)
    assert mine.overflowed == 0
    mine.set("one-too-many", 9)
    assert mine.overflowed == 1
    assert other.others("one-too-many") == 0
    assert all(other.others(f"b{i}") == 1 for i in range(0, SLOTS, 97))


def test_the_hosts_metrics_sum_counters_and_own_gauges_and_take_the_fleets_once() -> None:
    def worker(requests: float, waiting: float, engine: float, created: float) -> str:
        registry = CollectorRegistry()
        c = Counter("llm_gateway_requests", "Requests.", ["status"], registry=registry)
        c.labels("200").inc(requests)
        h = Histogram("llm_gateway_ttft_seconds", "TTFT.", buckets=(0.1, 1.0), registry=registry)
        h.observe(0.05)
        Gauge(ADMISSION_QUEUE_METRIC, "Waiting here.", registry=registry).set(waiting)
        Gauge(FLEET_ENGINE_QUEUE_METRIC, "Engines.", registry=registry).set(engine)
        Gauge(QUEUE_DEPTH_METRIC, "Fleet.", registry=registry).set(engine + waiting)
        text = generate_latest(registry).decode()
        return re.sub(r"(_created\{[^}]*\}) [0-9.e+]+", rf"\1 {created}", text)

    merged = combine([worker(3, 1, 7, 200.0), worker(4, 2, 6, 100.0)])
    got = {
        (f.name, s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(merged.decode())
        for s in f.samples
    }
    ok = (("status", "200"),)
    assert got[("llm_gateway_requests", "llm_gateway_requests_total", ok)] == 7
    created = "llm_gateway_requests_created"  # a gauge family of its own in the text format
    assert got[(created, created, ok)] == 100  # the earliest
    ttft = "llm_gateway_ttft_seconds"
    assert got[(ttft, ttft + "_bucket", (("le", "0.1"),))] == 2
    assert got[(ttft, ttft + "_count", ())] == 2
    assert got[(ADMISSION_QUEUE_METRIC, ADMISSION_QUEUE_METRIC, ())] == 3  # summed
    assert got[(FLEET_ENGINE_QUEUE_METRIC, FLEET_ENGINE_QUEUE_METRIC, ())] == 7  # the first's
    assert got[(QUEUE_DEPTH_METRIC, QUEUE_DEPTH_METRIC, ())] == 10  # engines once + both queues
    assert got[(REPORTING_METRIC, REPORTING_METRIC, ())] == 2


async def test_a_stored_response_is_found_whichever_worker_a_follow_up_reaches() -> None:
    async with running_sim(FAST) as a, running_sim(FAST) as b, workers([a, b]) as w:
        made: list[str] = []
        for _ in range(4):
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
                s.post(w.url + "/v1/responses", json={"model": "sim-model", "input": "hi"}) as r,
            ):
                assert r.status == 200, await r.text()
                made.append((await r.json())["id"])
        for rid in made * 4:  # 16 connections: the kernel gives some to each worker
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
                s.get(w.url + f"/v1/responses/{rid}") as r,
            ):
                assert r.status == 200, await r.text()
                assert (await r.json())["id"] == rid
        await wait_for(lambda: len(w.events("request")) >= 20, what="requests logged")
        assert {e["worker"] for e in w.events("request")} == {0, 1}
