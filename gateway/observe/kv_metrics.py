"""Metrics of KV-event routing: each backend's feed, the index's size, ``precise_prefix``'s
decisions. Read at scrape time from the feeds, the index and the running policy."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.kv.sources import STATES, FeedStatus
from policies import KvIndex, Policy
from policies.capabilities import Capabilities
from policies.precise_prefix import REASONS

# What one index entry costs (an engine hash in an OrderedDict, our key in two dicts), as
# measured by `python -m loadtest.bench.kv_events` (RSS growth over 240,000 entries).
ENTRY_BYTES = 270


class KvEventsCollector(Collector):
    def __init__(
        self,
        index: KvIndex,
        feeds: Callable[[], Mapping[str, FeedStatus] | None],
        policy: Callable[[], Policy],
    ) -> None:
        self._index = index
        self._feeds = feeds
        self._policy = policy

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self._index_metrics()
        feeds = self._feeds()
        if feeds is not None:
            yield from self._feed_metrics(feeds)
        policy = Capabilities.of(self._policy()).exact_prefix
        if policy is not None:
            decisions = CounterMetricFamily(
                "llm_gateway_precise_prefix_decisions",
                "Why precise_prefix chose a backend: prefix (longest prefix its engine holds), "
                "balance (the load guard passed over a longer one), load (nobody holds any), "
                "session, session_overflow, fallback_no_tokens (no tokenizer for the model, or "
                "a prompt that cannot be tokenized), fallback_not_live (a candidate's KV events "
                "are not followed: routed by the approximate prefix index).",
                labels=["reason"],
            )
            for reason in REASONS:
                decisions.add_metric([reason], policy.decisions[reason])
            yield decisions

    def _index_metrics(self) -> Iterator[Metric]:
        stats = self._index.stats()
        blocks = GaugeMetricFamily(
            "llm_gateway_kv_index_blocks",
            "Blocks each backend's engine holds in its prefix cache, from its KV events.",
            labels=["backend"],
        )
        orphans = CounterMetricFamily(
            "llm_gateway_kv_index_orphan_blocks",
            "Stored blocks whose parent block was never seen (missed events): not indexed.",
            labels=["backend"],
        )
        for backend, st in stats.items():
            blocks.add_metric([backend], st.blocks)
            orphans.add_metric([backend], st.orphans)
        yield blocks
        yield orphans
        yield GaugeMetricFamily(
            "llm_gateway_kv_index_bytes",
            "Approximate memory of the KV-event index (entries x an estimated entry size).",
            value=self._index.size * ENTRY_BYTES,
        )
        yield GaugeMetricFamily(
            "llm_gateway_kv_index_capacity_blocks",
            "Most blocks the KV-event index keeps per backend.",
            value=self._index.capacity,
        )

    def _feed_metrics(self, feeds: Mapping[str, FeedStatus]) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "llm_gateway_kv_events_state",
            "1 for each backend's KV-event feed state: live (routed on exactly), off (it "
            "publishes no events), connecting, disconnected, undecodable, discovering.",
            labels=["backend", "state"],
        )
        events = CounterMetricFamily(
            "llm_gateway_kv_events",
            "KV-cache events applied, by backend and kind (stored, removed, cleared, skipped).",
            labels=["backend", "kind"],
        )
        gaps = CounterMetricFamily(
            "llm_gateway_kv_events_gaps",
            "Sequence gaps in a backend's events: replayed (repaired from the replay socket), "
            "lost (could not be: its entries were cleared), restart (the publisher restarted).",
            labels=["backend", "outcome"],
        )
        problems = CounterMetricFamily(
            "llm_gateway_kv_events_problems",
            "KV-event messages or events that could not be read, by backend and kind.",
            labels=["backend", "kind"],
        )
        lag = GaugeMetricFamily(
            "llm_gateway_kv_events_lag_seconds",
            "Age of each backend's newest KV-event batch when it was applied.",
            labels=["backend"],
        )
        for backend, st in feeds.items():
            for name in STATES:
                state.add_metric([backend, name], 1.0 if st.state == name else 0.0)
            for kind in ("stored", "removed", "cleared", "skipped"):
                events.add_metric([backend, kind], st.events[kind])
            for outcome in ("replayed", "lost", "restart"):
                gaps.add_metric([backend, outcome], st.gaps[outcome])
            for kind, n in st.problems.items():  # kinds are the decoder's own, a fixed set
                problems.add_metric([backend, kind], n)
            if st.lag_s is not None:
                lag.add_metric([backend], st.lag_s)
        yield from (state, events, gaps, problems, lag)
