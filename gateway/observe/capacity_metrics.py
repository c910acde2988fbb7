"""Capacity's metrics (``gateway.capacity``), read from its state when scraped: nothing is
counted on the request path beyond the hold's own counts.

Every replica exports its view of each engine's state and its held requests; the managing
replica (``llm_gateway_capacity_managing`` 1) also the demand model's figures: the engines each
model needs awake and what its demand asks for unbounded (``desired_engines``, the
autoscaler's signal: above the engines there are, more replicas are wanted), its decisions
and the engine-seconds asleep it counted (the fleet's sum over replicas counts each second
once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.pool import BackendPool
from backends.sleep import Rest
from gateway.capacity.hold import Holds
from gateway.capacity.manager import Manager


class CapacityCollector(Collector):
    def __init__(
        self,
        pool: BackendPool,
        holds: Callable[[], Holds | None],
        manager: Callable[[], Manager | None],
        ruled: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        self._pool = pool
        self._holds = holds
        self._manager = manager
        self._ruled = ruled  # the models (and pools) with a rule: their series from the start

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "llm_gateway_engine_state",
            "Each engine's state as this replica sees it (1 for the state it is in): awake, "
            "going_to_sleep (no new requests), asleep, waking.",
            labels=["backend", "state"],
        )
        for b in self._pool.all():
            rest = b.rest
            for r in Rest:
                state.add_metric([b.id, r.value], 1.0 if r is rest else 0.0)
        yield state
        holds = self._holds()
        if holds is not None:
            held = GaugeMetricFamily(
                "llm_gateway_capacity_held_requests",
                "Requests held here while an engine of their model wakes.",
                labels=["model"],
            )
            for model, n in holds.held.items():
                held.add_metric([model], n)
            yield held
            outcomes = CounterMetricFamily(
                "llm_gateway_capacity_holds",
                "Requests held for a wake, by how the hold ended: served, timed_out, left.",
                labels=["model", "outcome"],
            )
            counts = {(m, o): 0 for m in self._ruled() for o in ("served", "timed_out", "left")}
            counts.update(holds.outcomes)
            for (model, outcome), n in counts.items():
                outcomes.add_metric([model, outcome], n)
            yield outcomes
        manager = self._manager()
        if manager is None:
            return
        yield GaugeMetricFamily(
            "llm_gateway_capacity_managing",
            "1 if this replica manages the fleet's capacity now (holds the lease).",
            value=1.0 if manager.token is not None else 0.0,
        )
        decisions = CounterMetricFamily(
            "llm_gateway_capacity_decisions",
            "The manager's steps made here: sleep and wake (what the fleet wants), put_to_sleep "
            "and wake_up (the engine calls), by outcome: made, refused, failed.",
            labels=["action", "outcome"],
        )
        for (action, outcome), n in manager.decisions.items():
            decisions.add_metric([action, outcome], n)
        yield decisions
        asleep = CounterMetricFamily(
            "llm_gateway_capacity_asleep_seconds",
            "Engine-seconds asleep, counted by the replica managing at the time.",
            labels=["backend"],
        )
        for backend, seconds in manager.asleep_seconds.items():
            asleep.add_metric([backend], seconds)
        yield asleep
        if manager.token is None:
            return
        desired = GaugeMetricFamily(
            "llm_gateway_capacity_desired_engines",
            "Engines the demand model wants awake for the model (headroom included, not capped "
            "by the engines there are): the autoscaler's signal.",
            labels=["model"],
        )
        needed = GaugeMetricFamily(
            "llm_gateway_capacity_needed_engines",
            "Engines the manager keeps awake for the model (within min_awake and max_awake).",
            labels=["model"],
        )
        for model, need in manager.needs.items():
            desired.add_metric([model], need.desired)
            needed.add_metric([model], need.engines)
        yield desired
        yield needed
