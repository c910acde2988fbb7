"""A request's priority, as vLLM 0.32 reads it. Pure.

- The body's ``priority`` (chat, completions, responses, generate, pooling): an integer,
  lower runs first, 0 when absent. vLLM's pydantic field (``int``, between -2**63 and
  2**63 - 1) takes what lax mode takes (``"3"``, ``3.0``, ``true``) and refuses anything
  else, null included, with its validation 400 (``validation.BodyError``).
- The ``X-Vllm-Priority`` header (chat, completions, responses, the Messages API) overrides
  the body when ``int()`` reads it; a header it cannot read is ignored (vLLM's
  ``_get_priority``), not refused.

The engine orders by it only under ``--scheduling-policy priority``; under ``fcfs`` it is
read (and checked) all the same, and ignored.
"""

from __future__ import annotations

from typing import Any, Final

from tools.sim.validation import Fields, Problems, as_int

PRIORITY_HEADER: Final = "X-Vllm-Priority"
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1


def read_priority(fields: Fields) -> int:
    """The ``priority`` of the object ``fields`` reads (0 when absent); a bad one is added
    to its problems (and 0 returned)."""
    if "priority" not in fields.doc:
        return 0
    raw = fields.doc["priority"]
    value = as_int(fields, "priority", raw)
    if value is None:
        return 0
    if value < INT64_MIN:
        said = f"greater than or equal to {INT64_MIN}"
        fields.error("priority", "greater_than_equal", f"Input should be {said}", raw, ge=INT64_MIN)
        return 0
    if value > INT64_MAX:
        said = f"less than or equal to {INT64_MAX}"
        fields.error("priority", "less_than_equal", f"Input should be {said}", raw, le=INT64_MAX)
        return 0
    return value


def body_priority(body: dict[str, Any]) -> int:
    """The body's ``priority``, or vLLM's validation 400 for a bad one."""
    problems = Problems()
    value = read_priority(Fields(body, ("body",), problems))
    problems.check()
    return value


def with_header(priority: int, header: str | None) -> int:
    """``priority`` overridden by the ``X-Vllm-Priority`` header, if ``int()`` reads it."""
    if header is not None:
        try:
            return int(header)
        except ValueError:
            pass
    return priority


def request_priority(body: dict[str, Any], header: str | None) -> int:
    """A chat, completion or Responses request's priority: the header's, else the body's
    (the body is checked either way, as vLLM validates it before reading the header)."""
    return with_header(body_priority(body), header)
