"""A request's priority as the engines get it.

The gateway's priority (higher goes first: the admission queue's order) reaches the engines
that schedule by it (vLLM's ``--scheduling-policy priority``, where lower runs first: the
gateway's negated), as vLLM's ``X-Vllm-Priority`` header, which overrides the body's
``priority`` on chat, completions, responses and Messages; elsewhere (pooling, token-in
generation) in the body's field. Only to those engines (told per
backend: ``scheduling = "priority"``); under vLLM's default ``fcfs`` it would be ignored, and
is not sent. A client's own priority (the body field, or the header) stands only if its tier
lets it set it (``own_engine_priority``); otherwise the gateway's replaces it. Pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from gateway.limits.keys import Principal

VLLM_PRIORITY: Final = "X-Vllm-Priority"
# Where vLLM reads it (the header, or only the body's field: set there, the body rewritten for
# the engines that schedule by priority alone) is the endpoint's ``priority``
# (``gateway.request.endpoints``).


def with_priority(body: bytes, value: int) -> bytes:
    """A JSON body with vLLM's ``priority`` set to ``value`` (the client's replaced)."""
    doc = json.loads(body)
    doc["priority"] = value
    return json.dumps(doc, separators=(",", ":")).encode()


def engine_priority(
    doc: Mapping[str, Any], headers: Mapping[str, str], principal: Principal, priority: int
) -> int | None:
    """vLLM's priority to send for a request of ``priority`` (the gateway's), or None: nothing
    to send (the client's own stands, or there is nothing to say)."""
    own = "priority" in doc or VLLM_PRIORITY in headers
    if own and principal.own_engine_priority:
        return None
    if not own and priority == 0:
        return None
    return -priority
