"""One ``/metrics`` for a host running ``serve --workers N``: every worker's figures combined.

Prometheus scrapes the port, and the kernel hands the scrape to any one worker. That worker
asks the others for their own figures (each serves them on a private Unix socket, ``raw``)
and answers with the combination, as Prometheus' multiprocess mode would: counters, histograms
and summaries summed over the workers (a counter's ``_created`` the earliest); gauges of what
each process holds (its admission queue, its indexes' sizes) summed; every other gauge (the
backends' scraped load, health, circuit, scores, learned speed, which every worker observes of
the same fleet; in-flight counts, already the host's) from the answering worker. The fleet
queue depth an autoscaler scales on is the engines' queue once plus every worker's admission
queue. ``llm_gateway_workers_reporting`` says how many workers' figures are in the answer: a
worker that did not answer within the timeout is left out, not waited for.

Pure merging (``combine``) apart from the I/O that fetches the texts (``gather``). ``page`` is
every ``/metrics`` the gateway serves: the data plane's (the host's, with workers), the admin
API's and a worker's private one (``own_page``: this process's alone).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from gateway.observe.metrics import (
    ADMISSION_QUEUE_METRIC,
    FLEET_ENGINE_QUEUE_METRIC,
    QUEUE_DEPTH_METRIC,
)
from gateway.workers.supervisor import ask_peer

# Gauges of what each process holds apart: the host's is the sum.
ADDITIVE_GAUGES: Final = frozenset(
    {
        ADMISSION_QUEUE_METRIC,
        "llm_gateway_admission_holding",
        "llm_gateway_prefix_index_entries",
        "llm_gateway_prefix_index_bytes",
        "llm_gateway_kv_index_blocks",
        "llm_gateway_kv_index_bytes",
    }
)
_SUMMED_TYPES: Final = frozenset({"counter", "histogram", "summary", "gaugehistogram"})
_TIMEOUT_S: Final = 2.0
REPORTING_METRIC: Final = "llm_gateway_workers_reporting"
CONTENT_TYPE: Final = CONTENT_TYPE_LATEST  # a page's (Prometheus' text format)

_Key = tuple[str, tuple[tuple[str, str], ...]]


def combine(texts: Sequence[str]) -> bytes:
    """The exposition of several workers' ``/metrics`` texts combined (the first is the
    answering worker's: its gauges are the host's)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[_Key, float]] = {}
    for nth, text in enumerate(texts):
        for fam in text_string_to_metric_families(text):
            if fam.name not in families:
                families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                values[fam.name] = {}
            merged = values[fam.name]
            summed = fam.type in _SUMMED_TYPES or fam.name in ADDITIVE_GAUGES
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key not in merged:
                    if nth == 0 or summed:
                        merged[key] = s.value
                elif s.name.endswith("_created"):
                    merged[key] = min(merged[key], s.value)
                elif summed:
                    merged[key] += s.value
    engine = values.get(FLEET_ENGINE_QUEUE_METRIC, {}).get((FLEET_ENGINE_QUEUE_METRIC, ()))
    waiting = values.get(ADMISSION_QUEUE_METRIC, {}).get((ADMISSION_QUEUE_METRIC, ()))
    if QUEUE_DEPTH_METRIC in values and engine is not None:
        values[QUEUE_DEPTH_METRIC][(QUEUE_DEPTH_METRIC, ())] = engine + (waiting or 0.0)
    reporting = Metric(REPORTING_METRIC, "Workers whose figures this answer holds.", "gauge")
    families[REPORTING_METRIC] = reporting
    values[REPORTING_METRIC] = {(REPORTING_METRIC, ()): float(len(texts))}
    for name, fam in families.items():
        fam.samples = [Sample(n, dict(labels), v) for (n, labels), v in values[name].items()]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families.values()))
    return generate_latest(registry)


class _Fixed(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


async def page(registry: CollectorRegistry, peers: Sequence[Path] | None = None) -> bytes:
    """A ``/metrics`` page: this process's figures; with ``peers`` (a worker's: the other
    workers of its host, ``Worker.private_peers``), the host's, theirs combined in."""
    own = generate_latest(registry)
    if peers is None:
        return own
    return combine(await gather(own.decode(), peers))


def own_page(registry: CollectorRegistry) -> Handler:
    """The aiohttp handler of this process's own page: the admin API's ``/admin/metrics``, and
    a worker's private ``/metrics`` (what the worker answering a scrape gathers)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=await page(registry), headers={"Content-Type": CONTENT_TYPE})

    return handler


async def gather(own: str, peers: Sequence[Path]) -> list[str]:
    """This worker's text first, then each peer's that answered in time."""
    texts = await asyncio.gather(*(_fetch(p) for p in peers))
    return [own, *(t for t in texts if t is not None)]


async def _fetch(socket: Path) -> str | None:
    answer = await ask_peer(socket, "GET", "/metrics", within=_TIMEOUT_S)
    if isinstance(answer, str) or answer[0] != 200:
        return None
    return answer[1].decode()
