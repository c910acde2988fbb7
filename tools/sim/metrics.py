"""Prometheus exposition: vLLM V1's metric names, read from the engine at scrape time.

A custom collector on a per-app ``CollectorRegistry`` turns ``EngineStats`` and the
live gauges into metric families only when ``/metrics`` is scraped, so the hot path
never touches prometheus_client. Simulator-only series use the ``sim:`` prefix.

Sleep mode's series (``sleep.py``): ``vllm:engine_sleep_state`` always, as vLLM's;
``vllm:sleep_mode_operation_duration_seconds`` and ``vllm:sleep_mode_operations_in_flight``
(label ``operation`` only, as vLLM's) in dev mode, where its routes are; the simulator's GPU
memory model as ``sim:gpu_memory_used_bytes`` and ``sim:cpu_memory_offloaded_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tools.sim.driver import EngineDriver
from tools.sim.sleep import SLEEP_STATES
from tools.sim.sleep_mode import OPERATIONS, SleepReport
from tools.sim.stats import Histogram


@dataclass(frozen=True, slots=True)
class ServerCounters:
    """Numbers the HTTP layer keeps, read at scrape time."""

    injected_errors: int
    in_flight: int


class SimCollector(Collector):
    def __init__(
        self,
        model_name: str,
        driver: EngineDriver,
        server: Callable[[], ServerCounters],
        sleep: Callable[[], SleepReport],
        *,
        dev_mode: bool = False,
    ) -> None:
        self._model = model_name
        self._driver = driver
        self._server = server
        self._sleep = sleep
        self._dev_mode = dev_mode

    def describe(self) -> Iterable[Metric]:
        return []  # unchecked collector: families are built per scrape

    def collect(self) -> Iterable[Metric]:
        engine = self._driver.engine
        stats = engine.stats
        config = engine.config
        labels = ["model_name", "engine"]
        values = [self._model, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        def histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
            m = HistogramMetricFamily(name, doc, labels=labels)
            m.add_metric(values, [(le, float(n)) for le, n in h.cumulative()], h.sum)
            return m

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            len(engine.running),
        )
        yield gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            len(engine.waiting),
        )  # fmt: skip
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting, by reason.",
            labels=[*labels, "reason"],
        )
        by_reason.add_metric([*values, "capacity"], len(engine.waiting))
        by_reason.add_metric([*values, "deferred"], 0)
        yield by_reason
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            engine.pool.usage,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "enable_prefix_caching", "engine", "num_gpu_blocks"],
        )
        info.add_metric(
            [
                str(config.block_size),
                str(config.enable_prefix_caching),
                "0",
                str(config.num_gpu_blocks_override),
            ],
            1.0,
        )
        yield info
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits,
        )
        yield counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
            stats.num_preemptions,
        )  # fmt: skip
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            stats.generation_tokens,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*labels, "finished_reason"],
        )
        for reason, n in stats.request_success.items():
            success.add_metric([*values, reason], n)
        yield success
        yield histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            stats.ttft,
        )
        yield histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            stats.itl,
        )
        yield histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            stats.e2e,
        )
        yield histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            stats.queue_time,
        )
        yield histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            stats.prefill_time,
        )
        yield histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            stats.decode_time,
        )
        yield from self._sleep_metrics()
        yield from self._sim_metrics()

    def _sleep_metrics(self) -> Iterable[Metric]:
        report = self._sleep()
        state = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine "
            "is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.",
            labels=["model_name", "engine", "sleep_state"],
        )
        gauge = report.state.gauge()
        for name in SLEEP_STATES:
            state.add_metric([self._model, "0", name], gauge[name])
        yield state
        if self._dev_mode:
            durations = HistogramMetricFamily(
                "vllm:sleep_mode_operation_duration_seconds",
                "Duration of one sleep-mode operation.",
                labels=["operation"],
            )
            in_flight = GaugeMetricFamily(
                "vllm:sleep_mode_operations_in_flight",
                "Sleep-mode operations currently awaited.",
                labels=["operation"],
            )
            for op in OPERATIONS:
                buckets, total = report.durations[op]
                durations.add_metric([op], [(le, float(n)) for le, n in buckets], total)
                in_flight.add_metric([op], report.in_flight[op])
            yield durations
            yield in_flight
        memory = GaugeMetricFamily(
            "sim:gpu_memory_used_bytes",
            "GPU memory the model takes now: its weights and KV cache, unless asleep.",
            labels=["model_name"],
        )
        memory.add_metric([self._model], report.memory.gpu)
        yield memory
        offloaded = GaugeMetricFamily(
            "sim:cpu_memory_offloaded_bytes",
            "CPU memory holding the weights sleep level 1 offloaded.",
            labels=["model_name"],
        )
        offloaded.add_metric([self._model], report.memory.cpu_offloaded)
        yield offloaded

    def _sim_metrics(self) -> Iterable[Metric]:
        driver = self._driver
        stats = driver.engine.stats
        server = self._server()
        aborted = CounterMetricFamily(
            "sim:aborted_requests",
            "Requests aborted because the client went away, by the phase they were in.",
            labels=["model_name", "phase"],
        )
        for phase, n in stats.aborted.items():
            aborted.add_metric([self._model, phase], n)
        yield aborted
        yield CounterMetricFamily("sim:steps", "Engine steps run.", value=float(stats.steps))
        yield CounterMetricFamily(
            "sim:busy_simulated_seconds",
            "Simulated duration of all engine steps.",
            value=driver.busy_sim,
        )
        yield CounterMetricFamily(
            "sim:busy_wall_seconds",
            "Wall-clock time the engine loop took for those steps.",
            value=driver.busy_wall,
        )
        yield GaugeMetricFamily(
            "sim:clock_lag_seconds",
            "How far the wall clock is behind the simulated clock now.",
            value=driver.lag,
        )
        yield CounterMetricFamily(
            "sim:injected_errors", "Requests answered with an injected error.",
            value=float(server.injected_errors),
        )  # fmt: skip
        yield GaugeMetricFamily(
            "sim:http_requests_in_flight",
            "Generate requests being handled now.",
            value=float(server.in_flight),
        )


def make_registry(collector: SimCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
