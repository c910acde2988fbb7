"""What ``loadtest.bench.overload`` watches while it runs: the gateway's and the engines'
``/metrics`` every second, and the gateway's log once it is over."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import aiohttp

from loadtest import procs
from loadtest.bench.page import Families, families
from loadtest.bench.page import total as _total

WANTED: Final = (
    "llm_gateway_admission_",
    "llm_gateway_retry_budget_",
    "llm_gateway_stream_continuations_total",
    "llm_gateway_retries_total",
    "llm_gateway_hedges_total",
    "vllm:request_success_total",
    "vllm:num_requests_",
    "sim:aborted_requests_total",
)


def _families(text: str | None) -> Families:
    return families(text, WANTED)


def _by(fam: Families, name: str, *labels: str) -> dict[str, float]:
    """``name``'s samples by the values of ``labels`` (joined with ``_``)."""
    out: dict[str, float] = {}
    for ls, v in fam.get(name, []):
        key = "_".join(ls.get(label, "") for label in labels)
        out[key] = out.get(key, 0.0) + v
    return out


def received(fam: Families) -> float:
    """Requests an engine has received: ended (succeeded or aborted), running, waiting."""
    return sum(
        _total(fam, name)
        for name in (
            "vllm:request_success_total",
            "sim:aborted_requests_total",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
        )
    )


async def sampler(
    sims: dict[str, str],
    gateway: str,
    t0: float,
    in_flight: Callable[[], int],
    samples: list[dict[str, Any]],
) -> None:
    """Every second from ``t0`` (a ``perf_counter`` time) until cancelled: the gateway's and
    each live engine's figures (``sims``: their URLs by name), and the clients' requests in
    flight."""
    last: dict[str, float] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.8)) as s:
        k = int((time.perf_counter() - t0) // 1) + 1
        while True:
            delay = t0 + k - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # sleep-ok: the sampling period
            names = list(sims)
            texts = await asyncio.gather(
                *(procs.fetch_text(s, sims[n] + "/metrics") for n in names),
                procs.fetch_text(s, gateway + "/metrics"),
            )
            engines = {}
            for n, text in zip(names, texts[:-1], strict=True):
                fam = _families(text)
                if fam:  # a killed engine keeps what it had last received
                    last[n] = received(fam)
                engines[n] = {
                    "received": last.get(n, 0.0),
                    "running": _total(fam, "vllm:num_requests_running"),
                    "waiting": _total(fam, "vllm:num_requests_waiting"),
                    "up": bool(fam),
                }
            g = _families(texts[-1])
            samples.append(
                {
                    "t": round(time.perf_counter() - t0, 3),
                    "client_in_flight": in_flight(),
                    "queue": _total(g, "llm_gateway_admission_queue_length"),
                    "admission": _by(g, "llm_gateway_admission_outcomes_total", "outcome"),
                    "budget": _by(g, "llm_gateway_retry_budget_attempts_total", "kind", "outcome"),
                    "budget_use": _total(g, "llm_gateway_retry_budget_use"),
                    "continuations": _by(g, "llm_gateway_stream_continuations_total", "outcome"),
                    "retries": _total(g, "llm_gateway_retries_total"),
                    "engines": engines,
                    "loadavg_1m": round(os.getloadavg()[0], 2),
                }
            )
            k += 1


def admitted(sample: dict[str, Any]) -> float:
    """Requests the admission queue had let through (each one a deposit in the budget)."""
    adm = sample["admission"]
    return float(adm.get("admitted_at_once", 0.0) + adm.get("admitted_after_wait", 0.0))


def gateway_log(path: Path) -> dict[str, Any]:
    """The gateway's log, summed up: requests sent to an engine and their extra attempts
    (failovers and continuations), how requests ended, the other events by level."""
    sent = extra = 0
    endings: Counter[str] = Counter()
    events: Counter[str] = Counter()
    budget_refused: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            doc = json.loads(line)
            event = doc["event"]
            if event != "request":
                events[f"{doc.get('level')}:{event}"] += 1
                continue
            endings[f"{doc['status']} {doc['ending']}"] += 1
            if doc.get("retry_budget_refused"):
                budget_refused[doc["retry_budget_refused"]] += 1
            if doc.get("backend", "none") != "none":
                sent += 1
                extra += doc["attempts"] - 1
    return {
        "sent_to_engines": sent,
        "extra_attempts_in_log": extra,
        "budget_refused_in_log": dict(budget_refused),
        "endings": dict(endings.most_common()),
        "events": dict(events.most_common()),
    }
