"""Synthetic soak records for the soak's unit tests: observations, fault windows."""

from __future__ import annotations

from typing import Any

from loadtest.soak.faults import FaultWindow
from loadtest.soak.outcomes import ErrorInfo, Observation

BACKENDS = ("gpu-a", "gpu-b", "gpu-canary")
MIB = 1 << 20


def envelope(code: Any, type_: str = "service_unavailable") -> ErrorInfo:
    return ErrorInfo("m", type_, None, code, well_formed=True)


def obs(**kw: Any) -> Observation:
    fields: dict[str, Any] = {
        "index": 0,
        "replica": 0,
        "behaviour": "normal",
        "key": "web-app",
        "stream": True,
        "start": 10.0,
        "end": 11.0,
        "status": 200,
        "tokens": 8,
        "done": True,
    }
    return Observation(**(fields | kw))


def kill(target: str = "gpu-a", start: float = 20.0, end: float = 25.0) -> FaultWindow:
    return FaultWindow("kill", target, start, end)
