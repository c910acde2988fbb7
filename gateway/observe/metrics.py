"""Prometheus metrics of the gateway, on a registry of its own (never the global one).

Per-request figures are recorded once, when a request ends (``record_request``): nothing is
observed per SSE chunk. Per-backend figures are read from the pool when Prometheus scrapes,
by a collector, so they cost the request path nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from typing import Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.circuit import Circuit
from backends.health import Health
from backends.pool import BackendPool
from backends.supervise import Supervisor
from gateway.limits.admission import AdmissionQueue
from gateway.limits.limiter import Limiter
from policies import Policy, Weights, score
from policies.capabilities import Capabilities
from policies.prefix_affinity import REASONS

# From a few milliseconds (a cached prefix on an idle server) to minutes (long generations).
LATENCY_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0,
    7.5, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
ITL_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip

QUEUE_DEPTH_METRIC: Final = "inference_queue_depth"
FLEET_ENGINE_QUEUE_METRIC: Final = "llm_gateway_fleet_engine_queue_depth"
ADMISSION_QUEUE_METRIC: Final = "llm_gateway_admission_queue_length"
SUPERVISED_KINDS: Final = (
    "probe", "scrape", "models", "discovery", "idle_watchdog", "limits_backlog",
)  # fmt: skip


class BackendCollector(Collector):
    """Per-backend gauges and the fleet's queue depth, read from the pool at scrape time."""

    def __init__(
        self,
        pool: BackendPool,
        policy: Callable[[], Policy],
        gateway_queue: Callable[[], int],
    ) -> None:
        self._pool = pool
        self._policy = policy
        self._gateway_queue = gateway_queue

    def describe(self) -> list[Metric]:
        return []  # collected lazily; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        pool = self._pool
        now = pool.now()
        # Policies without weights (round robin, random) still get the default load score.
        weights = self._policy().weights or Weights()
        g = {
            name: GaugeMetricFamily(f"llm_gateway_backend_{name}", doc, labels=labels)
            for name, doc, labels in (
                ("in_flight", "Requests in flight from this gateway, all workers.", ["backend"]),
                ("queue_depth", "Scraped vllm:num_requests_waiting.", ["backend"]),
                ("running", "Scraped vllm:num_requests_running.", ["backend"]),
                ("kv_cache_usage", "Scraped vllm:kv_cache_usage_perc (0..1).", ["backend"]),
                ("scrape_age_seconds", "Age of the newest good /metrics scrape.", ["backend"]),
                ("up", "1 if the health probes say up.", ["backend"]),
                ("health", "Health state (1 for the current one).", ["backend", "state"]),
                ("circuit", "Circuit breaker state (1 for the current one).", ["backend", "state"]),
                ("draining", "1 while draining.", ["backend"]),
                ("score", "Current load score (lower is chosen first).", ["backend"]),
            )
        }
        fleet_waiting = 0
        routable = 0
        for b in pool.all():
            bid = [b.id]
            routable += pool.routable(b, now)
            g["in_flight"].add_metric(bid, pool.in_flight(b))
            if b.load is not None:
                g["queue_depth"].add_metric(bid, b.load.waiting)
                g["running"].add_metric(bid, b.load.running)
                if b.load.kv_cache_usage is not None:
                    g["kv_cache_usage"].add_metric(bid, b.load.kv_cache_usage)
                g["scrape_age_seconds"].add_metric(bid, now - b.load_at)
                fleet_waiting += b.load.waiting
            g["up"].add_metric(bid, 1.0 if b.health.state is Health.UP else 0.0)
            for h in Health:
                g["health"].add_metric([b.id, h.value], 1.0 if b.health.state is h else 0.0)
            for c in Circuit:
                g["circuit"].add_metric([b.id, c.value], 1.0 if b.circuit.state is c else 0.0)
            g["draining"].add_metric(bid, 1.0 if b.draining else 0.0)
            g["score"].add_metric(bid, score(pool.snapshot(b, now), weights))
        yield from g.values()
        yield GaugeMetricFamily(
            "llm_gateway_routable_backends",
            "Backends a request could be sent to now: healthy, circuit not open, not draining.",
            value=routable,
        )
        yield GaugeMetricFamily(
            FLEET_ENGINE_QUEUE_METRIC,
            "Requests waiting inside every backend engine (scraped), without the gateway's own "
            "queue. The same on every gateway replica: combine replicas with max.",
            value=fleet_waiting,
        )
        yield GaugeMetricFamily(
            QUEUE_DEPTH_METRIC,
            "Requests waiting in the fleet: every backend engine's queue (scraped) plus the "
            "gateway's own admission queue. Scale the fleet on this.",
            value=fleet_waiting + self._gateway_queue(),
        )


class AffinityCollector(Collector):
    """The ``prefix_affinity`` index's memory and decisions, under a policy that routes on it
    (``policies.capabilities.ApproximatePrefix``; nothing under the others)."""

    def __init__(self, policy: Callable[[], Policy]) -> None:
        self._policy = policy

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        source = Capabilities.of(self._policy()).approximate_prefix
        if source is None:
            return
        policy = source.approximate  # itself, or precise_prefix's fallback
        index = policy.index
        yield GaugeMetricFamily(
            "llm_gateway_prefix_index_entries",
            "Block hashes in the prefix_affinity index.",
            value=len(index),
        )
        yield GaugeMetricFamily(
            "llm_gateway_prefix_index_capacity",
            "Most block hashes the prefix_affinity index keeps.",
            value=index.capacity,
        )
        yield GaugeMetricFamily(
            "llm_gateway_prefix_index_bytes",
            "Approximate memory of the prefix_affinity index (estimated from its counts).",
            value=index.approx_bytes,
        )
        decisions = CounterMetricFamily(
            "llm_gateway_prefix_affinity_decisions",
            "Why prefix_affinity chose a backend: session, session_overflow (session backend "
            "overloaded), prefix (longest cached prefix), balance (the load guard passed over "
            "a longer prefix), load (no prefix told the candidates apart).",
            labels=["reason"],
        )
        for reason in REASONS:
            decisions.add_metric([reason], policy.decisions[reason])
        yield decisions


class LimitsCollector(Collector):
    """Rate-limit rejections and the admission queue, read from the limiter at scrape time."""

    def __init__(
        self,
        limiter: Callable[[], Limiter],
        admission: AdmissionQueue | None,
    ) -> None:
        self._limiter = limiter
        self._admission = admission

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        rejected = CounterMetricFamily(
            "llm_gateway_rate_limit_rejections",
            "Requests refused by a limit, by API key name and reason.",
            labels=["key", "reason"],
        )
        try:
            limiter: Limiter | None = self._limiter()
        except KeyError:  # the limiter is not up yet
            limiter = None
        for (key, reason), n in (limiter.rejections if limiter else {}).items():
            rejected.add_metric([key, reason], n)
        yield rejected
        if limiter is not None:
            yield GaugeMetricFamily(
                "llm_gateway_limits_store_up",
                "1 while the limits' store answers (always, in memory); 0 while Redis cannot be "
                "reached and its failure mode (open: no limits; closed: 503) applies.",
                value=1.0 if limiter.store.available else 0.0,
            )
            degraded = CounterMetricFamily(
                "llm_gateway_limits_degraded_admissions",
                "Requests admitted without their limits checked, by API key name: the shared "
                "store could not be reached and failure_mode is open.",
                labels=["key"],
            )
            counted = limiter.degraded_admissions
            # Every principal's series from the start (at 0): a rate over it has data.
            for key in dict.fromkeys([*limiter.auth.principal_ids(), *counted]):
                degraded.add_metric([key], counted[key])
            yield degraded
        queue = self._admission
        yield GaugeMetricFamily(
            ADMISSION_QUEUE_METRIC,
            "Requests waiting in this gateway's admission queue.",
            value=queue.waiting if queue is not None else 0,
        )
        if queue is not None:
            yield GaugeMetricFamily(
                "llm_gateway_admission_holding",
                "Requests admitted through the admission queue and not yet ended.",
                value=queue.holding,
            )
            outcomes = CounterMetricFamily(
                "llm_gateway_admission_outcomes",
                "What happened to requests at the admission queue.",
                labels=["outcome"],
            )
            for outcome, n in asdict(queue.stats).items():
                outcomes.add_metric([outcome], n)
            yield outcomes


class SupervisorCollector(Collector):
    """Crashes of background loops, each restarted (``backends.supervise``)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        restarts = CounterMetricFamily(
            "llm_gateway_background_task_restarts",
            "Background loops (probe, scrape, models, discovery, idle_watchdog, limits_backlog)"
            " that crashed and were restarted; each crash is logged as background_task_failed.",
            labels=["task"],
        )
        for kind in SUPERVISED_KINDS:
            restarts.add_metric([kind], self._supervisor.restarts[kind])
        yield restarts


class FleetState(Protocol):
    """What the metrics read of this replica as a member of its fleet (``Member``)."""

    losses: int
    heals: int

    @property
    def unknown(self) -> int: ...

    def log_state(self) -> str: ...


class FleetCollector(Collector):
    """The fleet's change log as this replica sees it: lost logs, heals, changes of unknown
    fate (``gateway.fleet.member``)."""

    def __init__(self, member: Callable[[], FleetState | None]) -> None:
        self._member = member

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        member = self._member()
        if member is None:
            return
        yield CounterMetricFamily(
            "llm_gateway_fleet_log_losses",
            "Times this replica found the fleet's change log lost, replaced by an older one or "
            "rewound (a Redis restarted empty); each is healed by the replica furthest ahead "
            "(fleet_log_lost, fleet_log_healed in the log).",
            value=member.losses,
        )
        yield CounterMetricFamily(
            "llm_gateway_fleet_log_heals",
            "Lost logs this replica wrote its state back into, as the replica furthest ahead.",
            value=member.heals,
        )
        state = GaugeMetricFamily(
            "llm_gateway_fleet_log_state",
            "The fleet's change log as this replica sees it: 1 for its state (ok; lost: being "
            "healed, admin changes refused; unreachable: Redis does not answer).",
            labels=["state"],
        )
        now = member.log_state()
        for name in ("ok", "lost", "unreachable"):
            state.add_metric([name], 1.0 if name == now else 0.0)
        yield state
        yield GaugeMetricFamily(
            "llm_gateway_fleet_changes_unknown",
            "Admin changes this replica answered 202 whose fate it does not know yet (Redis "
            "took them and did not answer); known as soon as Redis answers.",
            value=member.unknown,
        )


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(
            "llm_gateway_requests",
            "Requests by model, backend (the last one tried), status and endpoint (the "
            "names of gateway/request/endpoints.py: chat, completions, messages, responses, "
            "embeddings, tokenize, ...).",
            ["model", "backend", "status", "endpoint"],
            registry=r,
        )
        self.duration = Histogram(
            "llm_gateway_request_duration_seconds",
            "Time from the request's arrival to its end.",
            ["model", "backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "llm_gateway_time_to_first_token_seconds",
            "Time from the request's arrival to the first generated token, seen at the gateway.",
            ["model", "backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "llm_gateway_inter_token_latency_seconds",
            "Per request: mean time between output tokens after the first.",
            ["model", "backend"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "llm_gateway_retries",
            "Attempts that failed before the first byte and were retried elsewhere.",
            ["backend", "reason"],
            registry=r,
        )
        self.failovers = Counter(
            "llm_gateway_failovers",
            "Requests answered by a backend other than the first one chosen.",
            ["model"],
            registry=r,
        )
        self.aborts = Counter(
            "llm_gateway_upstream_aborts",
            "Upstream requests cut short, by reason.",
            ["backend", "reason"],
            registry=r,
        )
        self.continuations = Counter(
            "llm_gateway_stream_continuations",
            "Streams that broke after bytes reached the client, by what broke them "
            "(unreachable, timeout, stalled, protocol, engine_error) and what followed "
            "(continued: another backend finished it; broken: that one broke too; failed: no "
            "backend could continue it; or why it was not continued: tool_call, reasoning, "
            "token_prompt, limit...).",
            ["reason", "outcome"],
            registry=r,
        )
        # Every break's common outcomes from 0: a rate over them has data before the first.
        for reason in ("unreachable", "timeout", "stalled", "protocol", "engine_error"):
            for outcome in ("continued", "complete", "broken", "failed"):
                self.continuations.labels(reason, outcome)
        self.stalls = Counter(
            "llm_gateway_backend_stalls",
            "Backends taken out of rotation because none of their streams moved.",
            ["backend"],
            registry=r,
        )
        self.slo_requests = Counter(
            "llm_gateway_slo_requests",
            "Requests that stated a TTFT objective, by what followed: met (a backend was "
            "predicted to meet it), unmet (none was; sent anyway, no admission queue), waited "
            "(one was after waiting), late (none was within max_wait; sent, priority above 0), "
            "shed (none was within max_wait; 503 slo_unmeetable, priority 0).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("met", "unmet", "waited", "late", "shed"):
            self.slo_requests.labels(outcome)
        self.queue_wait = Histogram(
            "llm_gateway_admission_wait_seconds",
            "Time requests spent in the admission queue.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rescues_declined = Counter(
            "llm_gateway_rescues_declined",
            "predicted_latency's rescue: streams whose first token was late but were left on "
            "their backend, by why: gateway_lag (the event loop ran the deadline 20 ms late or "
            "more: the gateway itself is behind), no_other_backend (none could take it), "
            "others_queued (every other engine had requests waiting: the fleet is behind), "
            "hedge_budget (rescue_mode hedge: as many hedges running as [latency] hedge_budget "
            "allows), retry_budget (the extra attempts' budget is spent: [retry] budget_*).",
            ["reason"],
            registry=r,
        )
        for reason in (
            "gateway_lag",
            "no_other_backend",
            "others_queued",
            "hedge_budget",
            "retry_budget",
        ):
            self.rescues_declined.labels(reason)
        self.hedges = Counter(
            "llm_gateway_hedges",
            "predicted_latency's hedge (rescue_mode hedge): late streams raced on a second "
            "backend, by which attempt's first token came first: first, hedge, or neither "
            "(both failed before anything reached the client).",
            ["won"],
            registry=r,
        )
        for won in ("first", "hedge", "neither"):
            self.hedges.labels(won)
        self.monitor_reads = Counter(
            "llm_gateway_monitor_reads",
            "With serve --workers: the monitors' reads of backends (read: health, models, "
            "metrics) by what answered them (source: backend, or worker0 when worker 0's "
            "latest reading was taken instead of asking the backend again).",
            ["read", "source"],
            registry=r,
        )
        self.policy_changes = Counter(
            "llm_gateway_policy_changes", "Live policy or weight changes.", registry=r
        )
        # Disaggregated prefill/decode (gateway.request.disagg), one figure per step.
        self.disagg_prefill = Histogram(
            "llm_gateway_disagg_prefill_seconds",
            "Disaggregated requests: the prefill step's answered attempt, sent to answered.",
            ["model", "backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.disagg_handoff = Histogram(
            "llm_gateway_disagg_handoff_seconds",
            "Disaggregated requests: from the prefill's answer to the decode request sent "
            "(the gateway's own part of the handoff).",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.disagg_decode_ttft = Histogram(
            "llm_gateway_disagg_decode_first_token_seconds",
            "Disaggregated requests: from the decode request sent to its first token (the KV "
            "transfer, the decode queue and the first decode step; retries included).",
            ["model", "backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.disagg_failures = Counter(
            "llm_gateway_disagg_step_failures",
            "Disaggregated requests: failed attempts of a step, by step, backend and reason.",
            ["step", "backend", "reason"],
            registry=r,
        )

        # Model pools (gateway.request.rollout): one version of a model beside another.
        self.pool_requests = Counter(
            "llm_gateway_pool_requests",
            "Requests for an alias by the pool chosen and status.",
            ["alias", "pool", "status"],
            registry=r,
        )
        self.pool_errors = Counter(
            "llm_gateway_pool_errors",
            "Requests for an alias that failed (5xx, or an error after the stream began).",
            ["alias", "pool"],
            registry=r,
        )
        self.pool_ttft = Histogram(
            "llm_gateway_pool_time_to_first_token_seconds",
            "Time to first token of requests for an alias, by pool.",
            ["alias", "pool"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.pool_itl = Histogram(
            "llm_gateway_pool_inter_token_latency_seconds",
            "Per request for an alias: mean time between output tokens after the first.",
            ["alias", "pool"],
            buckets=ITL_BUCKETS,
            registry=r,
        )

        # Progressive rollouts (gateway.rollouts): where each stands, and why one was aborted.
        self.rollout_share = Gauge(
            "llm_gateway_rollout_canary_share",
            "The share of an alias's requests its rollout sends to the canary pool, in per "
            "cent (100 once promoted, 0 once aborted).",
            ["alias"],
            registry=r,
        )
        self.rollout_aborts = Counter(
            "llm_gateway_rollout_aborts",
            "Rollouts aborted by the driver on this replica, by alias and failed gate.",
            ["alias", "gate"],
            registry=r,
        )

    def rollout_aborted(self, alias: str, gates: Iterable[object]) -> None:
        """The driver here aborted ``alias``'s rollout: one count per failed gate."""
        for reading in gates:
            self.rollout_aborts.labels(alias, str(getattr(reading, "gate", reading))).inc()

    def known_pools(self, pairs: list[tuple[str, str]]) -> None:
        """Export each configured (alias, pool)'s error count at 0 before its first error, so a
        dashboard or an alert sees a series (and a rate of 0), not nothing."""
        for alias, pool in pairs:
            self.pool_errors.labels(alias, pool)

    def record_pool(
        self,
        alias: str,
        pool: str,
        status: int,
        ending: str,
        *,
        ttft: float | None,
        itl: float | None,
    ) -> None:
        """One finished request for an alias, counted for the pool that answered it."""
        self.pool_requests.labels(alias, pool, str(status)).inc()
        if status >= 500 or ending == "upstream_error":
            self.pool_errors.labels(alias, pool).inc()
        if ttft is not None:
            self.pool_ttft.labels(alias, pool).observe(ttft)
        if itl is not None:
            self.pool_itl.labels(alias, pool).observe(itl)

    def watch_limits(
        self,
        limiter: Callable[[], Limiter],
        admission: AdmissionQueue | None,
    ) -> None:
        self.registry.register(LimitsCollector(limiter, admission))

    def watch_supervisor(self, supervisor: Supervisor) -> None:
        self.registry.register(SupervisorCollector(supervisor))

    def watch_fleet(self, member: Callable[[], FleetState | None]) -> None:
        self.registry.register(FleetCollector(member))

    def watch_backends(
        self, pool: BackendPool, policy: Callable[[], Policy], gateway_queue: Callable[[], int]
    ) -> None:
        self.registry.register(BackendCollector(pool, policy, gateway_queue))
        self.registry.register(AffinityCollector(policy))
