"""vLLM's answer to a body its FastAPI model rejects, for the routes whose bodies the
simulator checks field by field (the Messages API, scale-out's render and generate). Pure.

vLLM validates a body before its route runs, so the answer is the same on every route, the
Messages API's included (its Anthropic error shape comes later, from the route): a 400 in
the OpenAI envelope, of type ``Bad Request`` (the status's phrase), listing pydantic's errors
as vLLM's handler prints them (``1 validation error:\\n  {'type': 'missing', 'loc':
'body.max_tokens', 'msg': 'Field required', 'input': '<dict of 2 items>'}``), with ``param``
the first error's place. A body that is not JSON, or not ``application/json``, is told the
same way.

``Fields`` reads one JSON object's fields with pydantic's lax rules for the types those
models declare (strings, integers, numbers, booleans, lists, objects, literals), collecting
each problem with pydantic's type and message; ``check`` raises them all as a ``BodyError``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from tools.sim.protocol import ApiError

_MAX_REPORTED: Final = 10  # vLLM's bounds on what an error echoes
_MAX_INPUT_CHARS: Final = 200
_MAX_ERROR_CHARS: Final = 1000
_TRUE: Final = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE: Final = frozenset({"0", "off", "f", "false", "n", "no"})
_INT_TEXT: Final = re.compile(r"\s*[+-]?\d+\s*")


class BodyError(ApiError):
    """A body rejected before its route runs: vLLM's validation 400, in the OpenAI envelope
    on every route (never translated into the Messages API's error shape)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(400, sanitize(message), param, "Bad Request")


def sanitize(message: str) -> str:
    """vLLM's ``sanitize_message``: no memory addresses or file paths in an error."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def unsupported_media_type() -> BodyError:
    return BodyError(
        "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed", None
    )


def parse_json(raw: bytes) -> Any:
    """The body's JSON, or FastAPI's ``json_invalid`` error at the offending character."""
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        raise BodyError(f"1 validation error:\n  JSON decode error: {exc}", None) from None
    except json.JSONDecodeError as exc:
        problems = Problems()
        ctx = {"error": exc.msg}
        problems.add("json_invalid", ("body", exc.pos), "JSON decode error", {}, ctx)
        raise problems.error() from None


def summary(value: Any) -> Any:
    """An error's ``input`` as vLLM echoes it: containers described, text bounded."""
    if isinstance(value, str):
        if len(value) > _MAX_INPUT_CHARS:
            return value[:_MAX_INPUT_CHARS] + "...[truncated]"
        return value
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    if len(text) > _MAX_INPUT_CHARS:
        return text[:_MAX_INPUT_CHARS] + "...[truncated]"
    return text


class Problems:
    """Validation errors as pydantic lists them, in the order it finds them."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[tuple[dict[str, Any], str]] = []  # (error, its dotted place)

    def add(
        self,
        kind: str,
        loc: tuple[str | int, ...],
        msg: str,
        value: Any,
        ctx: dict[str, Any] | None = None,
    ) -> None:
        where = ".".join(str(p) for p in loc)
        error: dict[str, Any] = {"type": kind, "loc": where, "msg": msg, "input": summary(value)}
        if ctx is not None:
            error["ctx"] = ctx
        self.items.append((error, where))

    def check(self) -> None:
        """Raise vLLM's 400 for the errors found, if any."""
        if self.items:
            raise self.error()

    def error(self) -> BodyError:
        """vLLM's 400 for the errors found (at least one)."""
        count = len(self.items)
        label = "error" if count == 1 else "errors"
        lines = []
        for error, _ in self.items[:_MAX_REPORTED]:
            text = str(error)
            if len(text) > _MAX_ERROR_CHARS:
                text = text[:_MAX_ERROR_CHARS] + "...[truncated]"
            lines.append(f"  {text}\n")
        if count > _MAX_REPORTED:
            lines.append(f"  ...and {count - _MAX_REPORTED} more {label}\n")
        message = f"{count} validation {label}:\n" + "".join(lines)
        return BodyError(message.rstrip(), self.items[0][1])


def expected(choices: tuple[str, ...]) -> str:
    """pydantic's list of a literal's values: ``'a', 'b' or 'c'``."""
    quoted = [repr(c) for c in choices]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


class Fields:
    """One JSON object's fields, read as a pydantic model would (lax mode), at ``loc``.

    Each reader returns the field's value (converted as pydantic converts it), or None
    when it is absent, null or wrong; wrong ones are added to ``problems``.
    """

    __slots__ = ("doc", "loc", "problems")

    def __init__(self, doc: dict[str, Any], loc: tuple[str | int, ...], problems: Problems) -> None:
        self.doc = doc
        self.loc = loc
        self.problems = problems

    @classmethod
    def body(cls, doc: Any, problems: Problems | None = None) -> Fields:
        """The request body, which must be an object (else its error, raised at once)."""
        problems = problems or Problems()
        if not isinstance(doc, dict):
            problems.add(
                "model_attributes_type",
                ("body",),
                "Input should be a valid dictionary or object to extract fields from",
                doc,
            )
            raise problems.error()
        return cls(doc, ("body",), problems)

    def nested(self, where: tuple[str | int, ...], value: Any) -> Fields | None:
        """A value (at ``where`` below this object) that is itself a model: its ``Fields``,
        or None (an error, as for the body: FastAPI reads models from attributes) if it is
        not an object."""
        if isinstance(value, dict):
            return Fields(value, (*self.loc, *where), self.problems)
        self.problems.add(
            "model_attributes_type",
            (*self.loc, *where),
            "Input should be a valid dictionary or object to extract fields from",
            value,
        )
        return None

    def _get(self, key: str, required: bool) -> tuple[bool, Any]:
        if key not in self.doc:
            if required:
                self.problems.add("missing", (*self.loc, key), "Field required", self.doc)
            return False, None
        value = self.doc[key]
        if value is None and not required:
            return False, None
        return True, value

    def error(self, key: str | int, kind: str, msg: str, value: Any, **ctx: Any) -> None:
        self.problems.add(kind, (*self.loc, key), msg, value, ctx or None)

    def value_error(self, key: str, reason: str, value: Any) -> None:
        """A model's own check failed (pydantic's ``value_error``)."""
        self.error(key, "value_error", f"Value error, {reason}", value, error=ValueError(reason))

    def string(self, key: str, *, required: bool = False) -> str | None:
        present, value = self._get(key, required)
        if not present:
            return None
        if isinstance(value, str):
            return value
        self.error(key, "string_type", "Input should be a valid string", value)
        return None

    def integer(self, key: str, *, required: bool = False) -> int | None:
        present, value = self._get(key, required)
        return as_int(self, key, value) if present else None

    def number(self, key: str, *, required: bool = False) -> float | None:
        present, value = self._get(key, required)
        if not present:
            return None
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
            kind, msg = (
                "float_parsing",
                "Input should be a valid number, unable to parse string as a number",
            )
        else:
            kind, msg = "float_type", "Input should be a valid number"
        self.error(key, kind, msg, value)
        return None

    def boolean(self, key: str, *, required: bool = False) -> bool | None:
        present, value = self._get(key, required)
        if not present:
            return None
        if isinstance(value, bool):
            return value
        if isinstance(value, int | float) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        if isinstance(value, int | float | str):
            kind, msg = "bool_parsing", "Input should be a valid boolean, unable to interpret input"
        else:
            kind, msg = "bool_type", "Input should be a valid boolean"
        self.error(key, kind, msg, value)
        return None

    def mapping(self, key: str, *, required: bool = False) -> dict[str, Any] | None:
        present, value = self._get(key, required)
        if not present:
            return None
        if isinstance(value, dict):
            return value
        self.error(key, "dict_type", "Input should be a valid dictionary", value)
        return None

    def array(self, key: str, *, required: bool = False) -> list[Any] | None:
        present, value = self._get(key, required)
        if not present:
            return None
        if isinstance(value, list):
            return value
        self.error(key, "list_type", "Input should be a valid list", value)
        return None

    def strings(self, key: str) -> list[str] | None:
        """An optional ``list[str]``."""
        items = self.array(key)
        if items is None:
            return None
        good = True
        for i, item in enumerate(items):
            if not isinstance(item, str):
                self.problems.add(
                    "string_type", (*self.loc, key, i), "Input should be a valid string", item
                )
                good = False
        return items if good else None

    def literal(self, key: str, choices: tuple[str, ...], *, required: bool = False) -> str | None:
        present, value = self._get(key, required)
        if not present:
            return None
        if isinstance(value, str) and value in choices:
            return value
        said = expected(choices)
        self.error(key, "literal_error", f"Input should be {said}", value, expected=said)
        return None


def as_int(fields: Fields, key: str | int, value: Any) -> int | None:
    """An integer as pydantic's lax mode takes one (a bool, a whole float, digits)."""
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        kind, msg = (
            "int_from_float",
            "Input should be a valid integer, got a number with a fractional part",
        )
    elif isinstance(value, str):
        if _INT_TEXT.fullmatch(value):
            return int(value)
        kind, msg = (
            "int_parsing",
            "Input should be a valid integer, unable to parse string as an integer",
        )
    else:
        kind, msg = "int_type", "Input should be a valid integer"
    fields.error(key, kind, msg, value)
    return None
