"""Gateway configuration: built once in ``main()`` and handed out in slices.

Sources, highest priority first: command-line overrides, ``GATEWAY_*`` environment variables
(nested fields with ``__``, e.g. ``GATEWAY_WEIGHTS__QUEUE=4``), the TOML file given with
``--config``, then the defaults below.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from backends.circuit import CircuitPolicy
from backends.health import HealthPolicy
from backends.kv.sources import FeedSettings
from gateway.capacity.settings import CapacitySettings
from gateway.config.declared import Section, declared
from gateway.config.routing import (
    AffinitySettings,
    DisaggSettings,
    LatencySettings,
    PoolSettings,
    RolloutSettings,
    WeightSettings,
)
from gateway.limits.retry_budget import RetryBudgetPolicy
from gateway.limits.settings import LimitsSettings
from gateway.request.retry import RetryPolicy
from gateway.rollouts.plan import Plan, PlanError
from gateway.rollouts.state import parse_plan
from policies import PolicyName
from policies.kv_index import KV_CAPACITY
from policies.precise_prefix import PrecisePrefix
from policies.rollout import WeightsError, check_weights


class BackendSettings(BaseModel):
    """One upstream server. A bare URL string is accepted in its place."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    name: str | None = None
    api_key: SecretStr | None = None
    drain: bool = Field(False, description="start draining: no new requests")
    role: Literal["both", "prefill", "decode"] = Field(
        "both", description="prefill/decode: a pool of disaggregated serving (see [disagg])"
    )
    scheduling: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="the engine's --scheduling-policy: priority engines are sent each "
        "request's priority (X-Vllm-Priority); fcfs ones (vLLM's default) would ignore it",
    )

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"backend url must start with http:// or https://, got {v!r}")
        return v

    @property
    def id(self) -> str:
        return self.name or self.url.split("://", 1)[1]


class UpstreamSettings(BaseModel):
    """Timeouts and pooling for connections to the backends."""

    model_config = ConfigDict(extra="forbid")

    connect_timeout: float = Field(5.0, gt=0, description="seconds to establish a connection")
    idle_timeout: float = Field(
        120.0, gt=0, description="seconds without a byte from the backend before giving up"
    )
    max_connections: int = Field(0, ge=0, description="0 means unlimited")
    keepalive_timeout: float = Field(
        4.0,
        gt=0,
        description="seconds an idle upstream connection is kept; keep it below the backend's"
        " own (vLLM: 5 s)",
    )


class ScrapeSettings(BaseModel):
    """How backend load and model lists are read."""

    model_config = ConfigDict(extra="forbid")

    interval: float = Field(0.25, gt=0, description="seconds between /metrics scrapes")
    timeout: float = Field(1.0, gt=0)
    stale_after: float = Field(
        2.0, gt=0, description="a scraped figure older than this is not trusted"
    )
    models_interval: float = Field(10.0, gt=0, description="seconds between /v1/models reads")


class HealthSettings(Section):
    """Active probes (GET /health) and the passive circuit breaker."""

    builds = ((HealthPolicy, ""), (CircuitPolicy, "circuit_"))

    interval: float = Field(2.0, gt=0, description="seconds between probes of each backend")
    timeout: float = Field(1.0, gt=0, description="a probe with no answer by then failed")
    fall: int = declared(HealthPolicy, "fall")
    rise: int = declared(HealthPolicy, "rise")
    circuit_threshold: int = declared(CircuitPolicy, "threshold")
    circuit_cooldown: float = declared(CircuitPolicy, "cooldown")
    circuit_growth: float = declared(CircuitPolicy, "growth")
    circuit_max_cooldown: float = declared(CircuitPolicy, "max_cooldown")
    stall_after: float = Field(
        20.0,
        ge=0,
        description="seconds without progress on every stream of a backend (one at least "
        "begun) before it is taken out of rotation and its streams continued elsewhere; 0: off."
        " Keep it above the longest prefill step",
    )


class RetrySettings(Section):
    """Failover to another backend, only before the first byte has reached the client; and the
    one budget that retries, hedges and stream continuations draw on (``budget_*``)."""

    builds = ((RetryPolicy, ""), (RetryBudgetPolicy, "budget_"))

    max_attempts: int = declared(RetryPolicy, "max_attempts")
    deadline: float = declared(RetryPolicy, "deadline")
    backoff_base: float = declared(RetryPolicy, "backoff_base")
    backoff_max: float = declared(RetryPolicy, "backoff_max")
    backoff_factor: float = declared(RetryPolicy, "backoff_factor")
    jitter: float = declared(RetryPolicy, "jitter")
    budget_ratio: float = declared(RetryBudgetPolicy, "ratio")
    budget_min_per_second: float = declared(RetryBudgetPolicy, "min_per_second")
    budget_window: float = declared(RetryBudgetPolicy, "window")


class ContinuationSettings(BaseModel):
    """A stream whose backend fails mid-way goes on from another backend
    (docs/operations.md, "Streams that survive a dying backend")."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    max_continuations: int = Field(
        3, ge=1, description="breaks one stream may survive; the next ends it with an error event"
    )
    max_attempts: int = Field(3, ge=1, description="backends tried for each continuation")
    deadline: float = Field(
        15.0, gt=0, description="seconds after a break within which a continuation must begin"
    )
    compact_bytes: int = Field(
        1024 * 1024,
        ge=4096,
        description="a stream's kept events past which they are parsed into text: memory per "
        "stream, against CPU on streams longer than this (about 6,000 tokens)",
    )
    tokenize_timeout: float = Field(
        2.0, gt=0, description="seconds for the backend's /tokenize to count what was sent"
    )


class ResponsesSettings(BaseModel):
    """Where the Responses API's stored responses live (``gateway.request.responses``)."""

    model_config = ConfigDict(extra="forbid")

    store: Literal["memory", "redis"] = Field(
        "memory",
        description="memory: this replica's; redis: every replica's, in the limits' Redis "
        "(limits.redis.url)",
    )
    capacity: int = Field(100_000, ge=1, description="response ids kept in this process")
    ttl: float = Field(
        86_400.0, gt=0, description="seconds a response id is kept in Redis (store = redis)"
    )


class KvEventsSettings(Section):
    """Following vLLM's KV-cache events, for ``precise_prefix`` (docs/routing.md, "Routing on
    what each engine really caches")."""

    builds = ((FeedSettings, ""),)
    also_declares = ((PrecisePrefix, ""),)

    enabled: bool | None = Field(
        None, description="follow the backends' KV events; unset: when the policy is precise_prefix"
    )
    discover: bool = declared(FeedSettings, "discover")
    endpoint: str | None = declared(FeedSettings, "endpoint")
    replay_endpoint: str | None = declared(FeedSettings, "replay_endpoint")
    topic: str = declared(FeedSettings, "topic")
    replay_timeout: float = declared(FeedSettings, "replay_timeout")
    rediscover_interval: float = declared(FeedSettings, "rediscover_interval")
    capacity: int = Field(
        KV_CAPACITY,
        ge=1024,
        description="blocks remembered per backend (at least its engine's KV blocks)",
    )
    max_blocks: int = declared(PrecisePrefix, "max_blocks")
    inline_chars: int = Field(
        4000, ge=0, description="longer prompts are tokenized off the event loop"
    )
    tokenize_threads: int = Field(2, ge=1, le=16)

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _template(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("tcp://", "ipc://")):
            raise ValueError("must be a ZMQ endpoint: tcp://HOST:PORT (HOST may be {host})")
        return v


class DiscoverySettings(BaseModel):
    """Backends found by re-resolving DNS names: every A/AAAA record is a backend."""

    model_config = ConfigDict(extra="forbid")

    dns: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="host:port names, e.g. vllm:8000"
    )
    interval: float = Field(5.0, gt=0, description="seconds between re-resolutions")
    scheme: Literal["http", "https"] = "http"
    api_key: SecretStr | None = None

    @field_validator("dns", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("dns", mode="after")
    @classmethod
    def _host_port(cls, v: list[str]) -> list[str]:
        for name in v:
            host, sep, port = name.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"discovery name must be host:port, got {name!r}")
        return v


class AdminSettings(BaseModel):
    """The admin API: its own listener, and off unless a token is set."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8081, ge=0, le=65535)
    token: SecretStr | None = Field(None, description="bearer token; no token, no admin API")

    @field_validator("token")
    @classmethod
    def _not_empty(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().strip():
            raise ValueError("admin.token is empty: unset it (no admin API) or give a secret")
        return v


class FleetSettings(BaseModel):
    """Replicas that share a Redis act as one gateway: every admin change goes through one
    ordered log there and is applied by each of them; the workers of one host without Redis
    keep the same log in files (docs/fleet.md)."""

    model_config = ConfigDict(extra="forbid")

    log: Literal["auto", "redis", "files", "off"] = Field(
        "auto",
        description="auto: on the limits' Redis (limits.redis) when limits.store or "
        "responses.store is redis, else in files when there are several workers or "
        "fleet.dir is set; redis or files: there, always; off: this process alone",
    )
    dir: Path | None = Field(
        None,
        description="where the log kept in files lives (it survives restarts there); unset: "
        "a private directory of serve --workers', gone when the gateway stops",
    )
    name: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="replicas with the same Redis, key prefix and name are one fleet",
    )
    replica: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.:-]{1,128}$",
        description="this replica's id in the fleet; unset: host name and process id",
    )
    wait: float = Field(
        1.0, gt=0, le=30, description="seconds an admin change waits for every replica to apply it"
    )
    report_interval: float = Field(
        2.0, gt=0, description="seconds between a replica's reports to the fleet's registry"
    )
    report_ttl: float = Field(
        6.0, gt=0, description="seconds after its last report a silent replica drops out"
    )
    start_timeout: float = Field(
        10.0,
        ge=0,
        description="seconds a starting replica tries to apply the log before it takes "
        "traffic; Redis still unreachable then: it starts on its file's state and catches up",
    )
    compact_every: int = Field(
        1000, ge=16, description="log entries past which a replica compacts it into a snapshot"
    )
    log_timeout: float = Field(
        2.0,
        gt=0,
        le=30,
        description="seconds an admin change waits for Redis to take it; past that it is "
        "answered 202 with its id, its fate unknown until Redis answers",
    )
    view_timeout: float = Field(
        1.0,
        gt=0,
        le=30,
        description="seconds a fleet view (replicas, changes, keys, usage, rollouts) waits for "
        "Redis before it answers from the last state known, marked stale",
    )

    @model_validator(mode="after")
    def _ttl_outlives_reports(self) -> FleetSettings:
        if self.report_ttl <= self.report_interval:
            raise ValueError("fleet.report_ttl must be longer than fleet.report_interval")
        return self


class ClientSettings(BaseModel):
    """What a client connection may do: a slow or idle client cannot hold one forever."""

    model_config = ConfigDict(extra="forbid")

    keepalive_timeout: float = Field(
        75.0, gt=0, description="seconds an idle (or silent new) connection is kept open"
    )
    header_timeout: float = Field(
        60.0, gt=0, description="seconds from a request's first byte to its whole head (408)"
    )
    body_timeout: float = Field(
        30.0, gt=0, description="seconds to receive a request body before a 408"
    )
    send_timeout: float = Field(
        60.0,
        gt=0,
        description="seconds a client may leave the answer unread before it is cut off",
    )
    max_header_bytes: int = Field(
        16 * 1024, ge=1024, description="longest request line or header field"
    )


class TlsSettings(BaseModel):
    """TLS termination: both files, or neither."""

    model_config = ConfigDict(extra="forbid")

    cert_file: Path | None = None
    key_file: Path | None = None

    @model_validator(mode="after")
    def _both_or_neither(self) -> TlsSettings:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls needs both cert_file and key_file")
        return self

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


class TracingSettings(BaseModel):
    """OpenTelemetry export; no endpoint, no tracing."""

    model_config = ConfigDict(extra="forbid")

    otlp_endpoint: str | None = Field(
        None, description="OTLP/HTTP traces URL, e.g. http://otel-collector:4318/v1/traces"
    )
    service_name: str = "llm-gateway"
    sample_ratio: float = Field(1.0, ge=0, le=1)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="GATEWAY_",
        env_nested_delimiter="__",
        extra="forbid",
    )

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    backends: Annotated[list[BackendSettings], NoDecode] = Field(default_factory=list)
    policy: PolicyName = "least_load"
    weights: WeightSettings = Field(default_factory=WeightSettings)
    affinity: AffinitySettings = Field(default_factory=AffinitySettings)
    latency: LatencySettings = Field(default_factory=LatencySettings)
    pools: list[PoolSettings] = Field(default_factory=list)
    aliases: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="public model name -> {pool: weight}"
    )
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    disagg: DisaggSettings = Field(default_factory=DisaggSettings)
    capacity: CapacitySettings = Field(default_factory=CapacitySettings)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    scrape: ScrapeSettings = Field(default_factory=ScrapeSettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    retry: RetrySettings = Field(default_factory=RetrySettings)
    continuation: ContinuationSettings = Field(default_factory=ContinuationSettings)
    kv_events: KvEventsSettings = Field(default_factory=KvEventsSettings)
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)
    tokenizers: dict[str, str] = Field(
        default_factory=dict,
        description="served model name -> its tokenizer: a model directory (tokenizer.json, "
        "tokenizer_config.json, chat template), a tokenizer.json, or `sim` for the simulator",
    )
    discovery: DiscoverySettings = Field(default_factory=DiscoverySettings)
    admin: AdminSettings = Field(default_factory=AdminSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    client: ClientSettings = Field(default_factory=ClientSettings)
    tls: TlsSettings = Field(default_factory=TlsSettings)
    backlog: int = Field(
        4096, ge=1, description="listen backlog: connections the kernel queues before accept"
    )
    workers: int | Literal["auto"] = Field(
        1,
        description="gateway processes accepting on the port (SO_REUSEPORT), one view of the "
        "fleet's in-flight counts per host; auto: the cores this process may use",
    )
    shutdown_grace: float = Field(
        30.0, ge=0, description="seconds in-flight streams get to finish on SIGTERM"
    )
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0)
    max_upload_bytes: int = Field(
        25 * 1024 * 1024,
        gt=0,
        description="largest multipart body (an audio upload), spooled to a temporary file "
        "above 1 MiB; larger is a 413 (vLLM's own audio limit is 25 MB)",
    )
    retry_after_seconds: int = Field(1, ge=0, description="Retry-After sent with a 503")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"

    @field_validator("backends", mode="before")
    @classmethod
    def _split_backends(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip()
            if v.startswith("["):
                return json.loads(v)
            v = [part for part in (p.strip() for p in v.split(",")) if part]
        if isinstance(v, list):
            return [{"url": item} if isinstance(item, str) else item for item in v]
        return v

    @field_validator("backends", mode="after")
    @classmethod
    def _unique_ids(cls, v: list[BackendSettings]) -> list[BackendSettings]:
        seen: set[str] = set()
        for b in v:
            if b.id in seen:
                raise ValueError(f"backend {b.id!r} is listed twice")
            seen.add(b.id)
        return v

    @field_validator("workers")
    @classmethod
    def _workers(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("workers must be at least 1 (or auto)")
        return v

    @property
    def worker_count(self) -> int:
        if self.workers == "auto":
            return max(1, len(os.sched_getaffinity(0)))
        return self.workers

    def per_process_limits(self) -> str | None:
        """Why these limits cannot hold across worker processes (None: they can): counted
        in each process's memory, N workers would let N times through."""
        if self.limits.store != "memory":
            return None
        limited = [
            name
            for name, t in self.limits.tiers.items()
            if t.requests_per_minute or t.tokens_per_minute or t.max_concurrent
        ]
        if not limited:
            return None
        return (
            f"limits.tiers {', '.join(sorted(limited))} set rate or concurrency limits, which "
            "the memory store counts per process: with workers > 1 set limits.store = "
            '"redis" (shared by every worker and replica), or run one worker'
        )

    @property
    def fleet_store(self) -> Literal["redis", "files"] | None:
        """Where the fleet's change log is (``[fleet] log``); None: admin changes apply to
        this process alone."""
        log = self.fleet.log
        if log == "auto":
            if "redis" in (self.limits.store, self.responses.store):
                return "redis"
            return "files" if self.fleet.dir is not None or self.worker_count > 1 else None
        return None if log == "off" else log

    def unshared_changes(self) -> str | None:
        """Why admin changes could not reach every process (None: they can)."""
        if self.fleet.log == "files" and self.fleet.dir is None and self.worker_count == 1:
            return 'fleet.log = "files" with one process needs fleet.dir (where they stay)'
        if self.worker_count > 1 and self.admin.token is not None and self.fleet_store is None:
            return (
                'fleet.log = "off" with workers > 1 would apply an admin change in one '
                'worker only: leave fleet.log = "auto"'
            )
        return None

    @property
    def follows_kv_events(self) -> bool:
        if self.kv_events.enabled is not None:
            return self.kv_events.enabled
        return self.policy == "precise_prefix" or (
            self.policy == "predicted_latency" and self.latency.prefix == "precise"
        )

    @model_validator(mode="after")
    def _pools_and_aliases(self) -> Settings:
        ids = {b.id for b in self.backends} | {b.url for b in self.backends}
        names: set[str] = set()
        for p in self.pools:
            if p.name in names:
                raise ValueError(f"pool {p.name!r} is listed twice")
            names.add(p.name)
            unknown = sorted(set(p.backends) - ids)
            if unknown:
                raise ValueError(f"pool {p.name!r}: unknown backend(s) {', '.join(unknown)}")
        for alias, weights in self.aliases.items():
            try:
                check_weights(weights, names)
            except WeightsError as exc:
                raise ValueError(f"alias {alias!r}: {exc}") from None
        self.rollout_plans(names)
        return self

    def rollout_plans(self, pools: Collection[str] | None = None) -> tuple[Plan, ...]:
        """``[rollout.plans]``, each checked (against ``pools``, the known ones, if given)."""
        plans = []
        for alias, doc in self.rollout.plans.items():
            if alias not in self.aliases:
                raise ValueError(f"rollout.plans.{alias}: no alias {alias!r} in [aliases]")
            try:
                plans.append(parse_plan(doc, alias).check(pools))
            except PlanError as exc:
                raise ValueError(f"rollout.plans.{alias}: {exc}") from None
        return tuple(plans)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))


def load_settings(config: Path | None = None, **overrides: Any) -> Settings:
    """Settings from ``config`` (TOML), the environment and ``overrides``, in rising priority."""
    if config is not None and not config.is_file():
        raise FileNotFoundError(f"config file not found: {config}")

    class _FromFile(Settings):
        model_config = SettingsConfigDict(toml_file=config)

    return _FromFile(**{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True, slots=True)
class FileLoader:
    """The settings as ``path``, the environment and the command line's ``overrides`` give them
    now (what SIGHUP and ``POST /admin/reload`` read again); ``path`` is where
    ``llm-gateway state export`` starts from."""

    path: Path | None
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self) -> Settings:
        return load_settings(self.path, **self.overrides)
