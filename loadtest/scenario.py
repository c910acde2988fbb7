"""Scenarios: a fleet of simulators, the gateway under one policy, a load, timed faults.

A scenario file (TOML, ``loadtest/scenarios/*.toml``) says what to start and what to send::

    name = "slow-backend"
    description = "one of three backends at a third of the speed"
    policies = ["least_load", "round_robin"]     # what ``compare`` runs by default

    [gateway]
    env = { GATEWAY_LOG_LEVEL = "warning" }      # GATEWAY_* settings for this run
    replicas = 1                                 # gateway processes; request i goes to
                                                 # replica i % replicas (GATEWAY_ADMIN__* env:
                                                 # the first's only)

    [[backends]]                                 # each entry: `count` x `llm-gateway sim ARGS`
    count = 2
    args = ["--max-num-seqs", "8"]
    [[backends]]
    args = ["--max-num-seqs", "8", "--slowdown", "3"]
    role = "both"                                # or "prefill" / "decode": disaggregated
                                                 # serving (give the sims --kv-role too)

    [workload]                                   # loadtest.workload.Workload's fields
    endpoint = "chat"
    prompt = { kind = "lognormal", median = 98, sigma = 1.0, low = 4, high = 1024 }
    output = { kind = "fixed", value = 64 }
    prefix = { groups = 4, length = 256, hot_share = 0.7 }   # hot_length: group 0's own

    [load]                                       # mode "open" (rate, burstiness) or "closed"
    mode = "open"                                # (concurrency); duration and/or requests
    rate = 8.0
    duration = 20
    warmup = 3

    [slo]                                        # goodput objectives, milliseconds
    ttft_ms = 2000
    itl_ms = 100

    [[events]]                                   # at `at` seconds, to backend N (0-based,
    at = 10                                      # in the order listed): "kill" it, change
    backend = 2                                  # its faults through /sim/faults ("faults",
    action = "kill"                              # with faults = { slowdown = 3 }), or, as an
                                                 # operator would, "drain" or "undrain" it in
                                                 # every replica through the admin API (the
                                                 # runner then gives each replica an admin
                                                 # listener of its own; a drain is applied
                                                 # once nothing is in flight to it, or 30 s)

Parsing is pure (``parse_scenario``); ``run_scenario`` starts the processes, drives the load
through the gateway, fires the events (one that fails ends the run with its error), and
scrapes every simulator's ``/metrics`` before and after (and at the end of the warm-up, once
the events due before it have been applied), so the report shows both sides: where
requests went, prefix-cache hits, preemptions.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import tomllib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import aiohttp

from loadtest import procs, promtext
from loadtest.arrivals import ClosedLoop, LoadShape, OpenLoop
from loadtest.client import ClientOptions, Live, RunResult, run_load
from loadtest.report import LabeledRun
from loadtest.stats import Slo
from loadtest.workload import LengthDist, PrefixGroups, Workload
from policies import POLICY_NAMES

SCENARIO_DIR: Final = Path(__file__).parent / "scenarios"
_ACTIONS: Final = ("kill", "faults", "drain", "undrain")
_GATEWAY_ACTIONS: Final = ("drain", "undrain")  # through each gateway replica's admin API
POLICIES: Final = POLICY_NAMES  # the gateway's --policy choices


class ScenarioError(ValueError):
    """A scenario file that cannot be run."""


@dataclass(frozen=True, slots=True)
class Event:
    at: float
    backend: int
    action: Literal["kill", "faults", "drain", "undrain"]
    faults: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    backends: tuple[tuple[str, ...], ...]  # simulator args, one entry per backend
    workload: Workload
    load: LoadShape
    slo: Slo = field(default_factory=Slo)
    policies: tuple[str, ...] = ("least_load", "round_robin")
    gateway_env: dict[str, str] = field(default_factory=dict)
    events: tuple[Event, ...] = ()
    roles: tuple[str, ...] = ()  # per backend: "both" (the default), "prefill", "decode"
    replicas: int = 1  # gateway processes; request i goes to replica i % replicas


def _check_keys(where: str, table: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = set(table) - allowed
    if unknown:
        raise ScenarioError(
            f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}"
        )


def _table(doc: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key, {})
    if not isinstance(value, dict):
        raise ScenarioError(f"[{key}] must be a table")
    return value


def _length(where: str, spec: Any) -> LengthDist:
    if isinstance(spec, int):
        return LengthDist.fixed(spec)
    if not isinstance(spec, dict):
        raise ScenarioError(f"{where}: a length is an integer or a table with 'kind'")
    _check_keys(where, spec, {"kind", "value", "low", "high", "median", "sigma"})
    try:
        return LengthDist(**spec)
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"{where}: {exc}") from exc


def _workload(w: dict[str, Any]) -> Workload:
    _check_keys(
        "[workload]",
        w,
        {"model", "endpoint", "stream", "prompt", "output", "prefix", "turns", "interleave",
         "ignore_eos", "seed"},
    )  # fmt: skip
    kwargs = dict(w)
    if "prompt" in kwargs:
        kwargs["prompt"] = _length("[workload] prompt", kwargs["prompt"])
    if "output" in kwargs:
        kwargs["output"] = _length("[workload] output", kwargs["output"])
    if "prefix" in kwargs:
        p = kwargs["prefix"]
        if not isinstance(p, dict):
            raise ScenarioError("[workload] prefix must be a table")
        _check_keys("[workload] prefix", p, {"groups", "length", "hot_share", "hot_length"})
        kwargs["prefix"] = PrefixGroups(**p)
    try:
        return Workload(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"[workload]: {exc}") from exc


def _load(lt: dict[str, Any]) -> LoadShape:
    _check_keys(
        "[load]",
        lt,
        {"mode", "rate", "burstiness", "concurrency", "duration", "requests", "warmup", "seed"},
    )
    mode = lt.get("mode", "open")
    try:
        arrivals: ClosedLoop | OpenLoop
        if mode == "open":
            arrivals = OpenLoop(float(lt["rate"]), float(lt.get("burstiness", 1.0)))
        elif mode == "closed":
            arrivals = ClosedLoop(int(lt["concurrency"]))
        else:
            raise ScenarioError(f"[load] mode must be 'open' or 'closed', got {mode!r}")
        return LoadShape(
            arrivals,
            duration=lt.get("duration"),
            requests=lt.get("requests"),
            warmup=float(lt.get("warmup", 0.0)),
            seed=int(lt.get("seed", 0)),
        )
    except KeyError as exc:
        raise ScenarioError(f"[load] mode {mode!r} needs {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"[load]: {exc}") from exc


def _events(raw: list[dict[str, Any]], n_backends: int) -> list[Event]:
    events = []
    for i, e in enumerate(raw):
        _check_keys(f"[[events]] #{i}", e, {"at", "backend", "action", "faults"})
        action = e.get("action", "faults")
        if action not in _ACTIONS:
            raise ScenarioError(
                f"[[events]] #{i}: action must be one of {', '.join(_ACTIONS)}, got {action!r}"
            )
        backend = int(e.get("backend", -1))
        if not 0 <= backend < n_backends:
            raise ScenarioError(f"[[events]] #{i}: no backend {backend} (0..{n_backends - 1})")
        if action != "faults" and "faults" in e:
            raise ScenarioError(f"[[events]] #{i}: a {action} event takes no faults table")
        if action == "faults" and not e.get("faults"):
            raise ScenarioError(f"[[events]] #{i}: a faults event needs a faults table")
        events.append(Event(float(e["at"]), backend, action, dict(e.get("faults", {}))))
    return events


def parse_scenario(text: str, *, source: str = "<scenario>") -> Scenario:
    """A ``Scenario`` from TOML text; ``ScenarioError`` names what is wrong."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{source}: {exc}") from exc
    _check_keys(
        source,
        doc,
        {"name", "description", "policies", "gateway", "backends", "workload", "load", "slo",
         "events"},
    )  # fmt: skip
    backends: list[tuple[str, ...]] = []
    roles: list[str] = []
    raw_backends = doc.get("backends", [])
    if not isinstance(raw_backends, list) or not raw_backends:
        raise ScenarioError(f"{source}: needs at least one [[backends]] entry")
    for i, b in enumerate(raw_backends):
        _check_keys(f"[[backends]] #{i}", b, {"count", "args", "role"})
        args = b.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ScenarioError(f"[[backends]] #{i}: args must be a list of strings")
        role = b.get("role", "both")
        if role not in ("both", "prefill", "decode"):
            raise ScenarioError(f"[[backends]] #{i}: role must be both, prefill or decode")
        backends += [tuple(args)] * int(b.get("count", 1))
        roles += [role] * int(b.get("count", 1))
    gw = _table(doc, "gateway")
    _check_keys("[gateway]", gw, {"env", "replicas"})
    replicas = gw.get("replicas", 1)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ScenarioError("[gateway] replicas must be a whole number, at least 1")
    slo = _table(doc, "slo")
    _check_keys("[slo]", slo, {"ttft_ms", "itl_ms", "e2e_ms"})
    events = _events(doc.get("events", []), len(backends))
    policies = tuple(doc.get("policies", ("least_load", "round_robin")))
    for p in policies:
        if p not in POLICIES:
            raise ScenarioError(f"unknown policy {p!r}; known: {', '.join(POLICIES)}")

    def ms(key: str) -> float | None:
        v = slo.get(key)
        return None if v is None else float(v) / 1e3

    return Scenario(
        name=str(doc.get("name", Path(source).stem)),
        description=str(doc.get("description", "")),
        backends=tuple(backends),
        workload=_workload(_table(doc, "workload")),
        load=_load(_table(doc, "load")),
        slo=Slo(ttft=ms("ttft_ms"), itl=ms("itl_ms"), e2e=ms("e2e_ms")),
        policies=policies,
        gateway_env={str(k): str(v) for k, v in _table(gw, "env").items()},
        replicas=replicas,
        events=tuple(sorted(events, key=lambda e: e.at)),
        roles=tuple(roles) if any(r != "both" for r in roles) else (),
    )


def find_scenario(name_or_path: str) -> Path:
    """A path as given, else ``loadtest/scenarios/<name>.toml``."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    bundled = SCENARIO_DIR / f"{name_or_path}.toml"
    if bundled.is_file():
        return bundled
    known = ", ".join(sorted(p.stem for p in SCENARIO_DIR.glob("*.toml")))
    raise ScenarioError(f"no scenario file {name_or_path!r} (bundled: {known})")


def load_scenario(name_or_path: str) -> Scenario:
    path = find_scenario(name_or_path)
    return parse_scenario(path.read_text(), source=str(path))


async def _scrape(session: aiohttp.ClientSession, sims: list[procs.Proc]) -> list[dict[str, float]]:
    texts = await asyncio.gather(*(procs.fetch_text(session, f"{s.url}/metrics") for s in sims))
    return [promtext.totals(t) if t is not None else {} for t in texts]


async def _scrape_gateway(session: aiohttp.ClientSession, gateway: procs.Proc) -> dict[str, float]:
    text = await procs.fetch_text(session, f"{gateway.url}/metrics")
    return promtext.totals(text, promtext.GATEWAY_FAMILIES) if text else {}


async def _settled(
    session: aiohttp.ClientSession, sims: list[procs.Proc], gateway: procs.Proc, within: float = 3.0
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Scrape until two scrapes agree: the servers' own bookkeeping of the last requests (their
    ``finally`` blocks) may run a moment after the client saw the end of the stream."""
    last: tuple[list[dict[str, float]], dict[str, float]] | None = None
    deadline = asyncio.get_running_loop().time() + within
    while True:
        now = (await _scrape(session, sims), await _scrape_gateway(session, gateway))
        if now == last or asyncio.get_running_loop().time() > deadline:
            return now
        last = now
        await asyncio.sleep(0.1)  # sleep-ok: interval between two comparison scrapes


def _start_gateways(
    sc: Scenario,
    policy: str,
    urls: list[str],
    *,
    env: dict[str, str],
    log_dir: Path,
    token: str,
    gateways: list[procs.Proc],
) -> list[str]:
    """Start the replicas into ``gateways``; with drain or undrain events, each replica's admin
    API (an admin listener of its own, ``token`` its bearer token)."""
    operated = any(e.action in _GATEWAY_ACTIONS for e in sc.events)
    # Each replica's port and, with drain events, its admin port: all taken at once, so that no
    # two replicas are given the same one.
    ports = procs.free_ports(sc.replicas * (2 if operated else 1))
    admins: list[str] = []
    for k in range(sc.replicas):
        # Replicas after the first share nothing with it, not even the admin listener.
        own = env if k == 0 else {n: v for n, v in env.items() if "_ADMIN__" not in n}
        if operated:
            admin_port = ports[sc.replicas + k]
            own = {
                **own,
                "GATEWAY_ADMIN__HOST": "127.0.0.1",
                "GATEWAY_ADMIN__PORT": str(admin_port),
                "GATEWAY_ADMIN__TOKEN": token,
            }
            admins.append(f"http://127.0.0.1:{admin_port}")
        name = "gateway" if k == 0 else f"gateway{k}"
        gateways.append(
            procs.start_gateway(urls, policy, log_dir, env=own, name=name, port=ports[k])
        )
    return admins


@dataclass(slots=True)
class _Events:
    """Fires a scenario's events. The first that fails voids the run: ``until_failed`` stops the
    load and raises its error (``run_load`` itself drops what its timed actions raise)."""

    session: aiohttp.ClientSession
    sims: list[procs.Proc]
    admins: list[str]  # each gateway replica's admin API (only with drain or undrain events)
    token: str
    ids: list[list[str]]  # per replica, each backend's id there
    failed: asyncio.Future[None]
    # each event's time and whether it has been applied (or has failed)
    applied: list[tuple[float, asyncio.Event]] = field(default_factory=list)

    @classmethod
    async def ready(
        cls,
        session: aiohttp.ClientSession,
        sims: list[procs.Proc],
        admins: list[str],
        token: str,
    ) -> _Events:
        """Looks up each replica's backend ids now, before the load: an admin listener that
        does not answer fails the run before there is a run to lose."""
        urls = [s.url for s in sims]
        ids = [await procs.admin_backend_ids(session, a, token, urls) for a in admins]
        failed = asyncio.get_running_loop().create_future()
        return cls(session, sims, admins, token, ids, failed)

    def action(self, e: Event) -> Callable[[], Awaitable[None]]:
        done = asyncio.Event()
        self.applied.append((e.at, done))

        async def act() -> None:
            try:
                await self._apply(e)
            except Exception as exc:
                if not self.failed.done():
                    why = f"event at {e.at} s ({e.action} backend {e.backend}) failed: {exc}"
                    self.failed.set_exception(RuntimeError(why))
            finally:
                done.set()

        return act

    async def applied_until(self, at: float) -> None:
        """Wait until every event due at or before ``at`` s has been applied (or failed)."""
        await asyncio.gather(*(done.wait() for t, done in self.applied if t <= at))

    async def _apply(self, e: Event) -> None:
        if e.action == "kill":
            self.sims[e.backend].kill()
        elif e.action in _GATEWAY_ACTIONS:  # every replica at once
            draining = e.action == "drain"
            replicas = list(zip(self.admins, self.ids, strict=True))
            await asyncio.gather(
                *(
                    procs.set_draining(self.session, a, self.token, ids[e.backend], draining)
                    for a, ids in replicas
                )
            )
            if draining:  # applied once what was in flight to it has finished (or 30 s)
                await asyncio.gather(
                    *(
                        procs.wait_idle(self.session, a, self.token, ids[e.backend])
                        for a, ids in replicas
                    )
                )
        else:
            await procs.put_faults(self.session, self.sims[e.backend], e.faults)

    async def until_failed(self, run: Awaitable[RunResult]) -> RunResult:
        """``run``'s result, unless an event fails first: then ``run`` is cancelled and the
        event's error raised."""
        load = asyncio.ensure_future(run)
        try:
            either: list[asyncio.Future[Any]] = [load, self.failed]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not load.done():
                load.cancel()
                await asyncio.gather(load, return_exceptions=True)
        if self.failed.done():
            self.failed.result()  # raises the event's error
        return load.result()


async def run_scenario(
    sc: Scenario,
    policy: str,
    out_dir: Path,
    *,
    on_tick: Callable[[Live], None] | None = None,
    options: ClientOptions | None = None,
) -> LabeledRun:
    """Start the fleet and the gateway, drive the load, stop everything; the run's results."""
    log_dir = out_dir / "logs" / policy
    token = secrets.token_hex(8)
    sims = [
        procs.start_sim(f"sim{i}", args, log_dir, admin_token=token)
        for i, args in enumerate(sc.backends)
    ]
    gateways: list[procs.Proc] = []
    try:
        await asyncio.gather(*(procs.wait_sim_url(s) for s in sims))
        env = {"GATEWAY_LOG_LEVEL": "warning", **sc.gateway_env}
        urls = [s.url for s in sims]
        if sc.roles:  # the gateway's JSON form of --backends carries each one's role
            urls = [
                json.dumps([{"url": u, "role": r} for u, r in zip(urls, sc.roles, strict=True)])
            ]
        admins = _start_gateways(
            sc, policy, urls, env=env, log_dir=log_dir, token=token, gateways=gateways
        )
        await asyncio.gather(*(procs.wait_ok(g, "/ready") for g in gateways))
        gateway = gateways[0]
        async with aiohttp.ClientSession() as session:
            events = await _Events.ready(session, sims, admins, token)
            before = await _scrape(session, sims)
            gw_before = await _scrape_gateway(session, gateway)
            warm: list[dict[str, float]] = []

            timed = [(e.at, events.action(e)) for e in sc.events]

            async def warmed_up() -> None:
                # the measured window opens once the events due before it have taken effect
                await events.applied_until(sc.load.warmup)
                warm[:] = await _scrape(session, sims)

            if sc.load.warmup > 0:
                timed.append((sc.load.warmup, warmed_up))
            cpu0 = [procs.cpu_seconds(g.pid) for g in gateways]
            result = await events.until_failed(
                run_load(
                    [g.url for g in gateways],
                    sc.workload,
                    sc.load,
                    options,
                    on_tick=on_tick,
                    timed=timed,
                )
            )
            gw_cpu = sum(procs.cpu_seconds(g.pid) for g in gateways) - sum(cpu0)
            gw_rss = sum(procs.rss_bytes(g.pid) for g in gateways)
            after, gw_after = await _settled(session, sims, gateway)
    finally:
        procs.stop_all([*sims, *gateways])
    backends = [
        {
            "name": s.name,
            "args": list(sc.backends[i]),
            "killed": s.killed,
            "metrics": promtext.delta(before[i], after[i]) if after[i] else None,
            # The same counters from the end of the warm-up on (what the other figures cover).
            "measured": promtext.delta(warm[i], after[i]) if warm and after[i] else None,
        }
        for i, s in enumerate(sims)
    ]
    return LabeledRun.of(
        policy,
        result,
        sc.slo,
        scenario=sc.name,
        policy=policy,
        backends=backends,
        gateway={
            "cpu_s": round(gw_cpu, 3),
            "rss_mb": round(gw_rss / 2**20, 1),
            "metrics": promtext.delta(gw_before, gw_after),  # the first replica's
            "replicas": sc.replicas,
        },
        commands={
            "gateway": gateways[0].cmd if gateways else None,
            "sims": [_redact(s.cmd) for s in sims],
        },
    )


def _redact(cmd: list[str]) -> list[str]:
    """The command with the per-run admin token blanked out."""
    return [
        "***" if i > 0 and cmd[i - 1] == "--admin-token" else part for i, part in enumerate(cmd)
    ]
