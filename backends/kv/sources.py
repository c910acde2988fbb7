"""Where a backend's KV-cache events come from, and what the gateway shows of following them.

Pure (no ZMQ here, so the app, the admin API and metrics can read feeds' status without
loading the event machinery): ``parse_sources`` reads vLLM's ``GET /kv_event_sources`` answer,
``reach`` makes a wildcard endpoint one the gateway can connect to, ``FeedStatus`` is one
backend's feed as ``backends.kv.feed`` keeps it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from policies.setting import check_settings, spec

STATES: Final = ("discovering", "off", "connecting", "live", "disconnected", "undecodable")
_WILDCARDS: Final = ("*", "0.0.0.0", "::", "[::]", "")


@dataclass(frozen=True, slots=True)
class FeedSettings:
    discover: bool = field(default=True, metadata=spec("ask each backend's GET /kv_event_sources"))
    endpoint: str | None = field(
        default=None,
        metadata=spec(
            "else subscribe here: a template with {host}, the backend's host, e.g. tcp://{host}:5557",
        ),
    )
    replay_endpoint: str | None = field(default=None, metadata=spec("e.g. tcp://{host}:5558"))
    topic: str = field(default="", metadata=spec("the topic subscribed to (empty: every topic)"))
    replay_timeout: float = field(
        default=2.0, metadata=spec("seconds a replay request may take", gt=0)
    )
    rediscover_interval: float = field(
        default=5.0,
        metadata=spec("seconds between looks at a backend that publishes no events", gt=0),
    )
    poll_interval: float = 0.25  # how often a feed looks at its backend's health
    silent_warning_s: float = 10.0  # no publisher connected this long: warn

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True, slots=True)
class Source:
    """One publisher of a backend (one per data-parallel rank)."""

    rank: int
    endpoint: str
    replay: str | None
    topic: str = ""


@dataclass(slots=True)
class FeedStatus:
    """What the admin API, metrics and ``kv-events check`` show of one backend's feed."""

    state: str = "discovering"
    why: str = ""
    sources: tuple[Source, ...] = ()
    batches: int = 0
    events: Counter[str] = field(default_factory=Counter)  # stored/removed/cleared/skipped
    problems: Counter[str] = field(default_factory=Counter)
    gaps: Counter[str] = field(default_factory=Counter)  # replayed/lost/restart
    form: str | None = None  # the wire form the publisher speaks
    lag_s: float | None = None  # now - the newest batch's timestamp, when it was applied


def reach(endpoint: str, backend_url: str) -> str:
    """``endpoint`` as the gateway can connect to it: a wildcard host becomes the backend's."""
    if not endpoint.startswith("tcp://"):
        return endpoint  # ipc:// (same host) and others: as they are
    hostport = endpoint[len("tcp://") :]
    host, sep, port = hostport.rpartition(":")
    if not sep:
        raise ValueError(f"endpoint {endpoint!r} has no port")
    if host in _WILDCARDS:
        backend_host = urlsplit(backend_url).hostname or "127.0.0.1"
        if ":" in backend_host:
            backend_host = f"[{backend_host}]"
        return f"tcp://{backend_host}:{port}"
    return endpoint


def parse_sources(doc: Any, backend_url: str) -> list[Source] | str:
    """Publishers from a ``/kv_event_sources`` answer, or why none can be followed."""
    if not isinstance(doc, dict):
        return "its /kv_event_sources answer is not a JSON object"
    out: list[Source] = []
    for rank, cfg in sorted(doc.items(), key=lambda kv: str(kv[0])):
        if not isinstance(cfg, dict) or not cfg.get("enable_kv_cache_events"):
            continue
        if cfg.get("publisher") not in ("zmq", None):
            return f"its publisher is {cfg.get('publisher')!r}, not zmq"
        endpoint = cfg.get("endpoint")
        if not isinstance(endpoint, str):
            return "its /kv_event_sources names no endpoint"
        replay = cfg.get("replay_endpoint")
        try:
            r = int(rank)
        except ValueError:
            r = len(out)
        out.append(
            Source(
                r,
                reach(endpoint, backend_url),
                reach(replay, backend_url) if isinstance(replay, str) else None,
                str(cfg.get("topic") or ""),
            )
        )
    if not out:
        return "it publishes no KV events (start vLLM with --kv-events-config)"
    return out
