"""Token accounting, pure: what a request reserves, what it really used, and the usage chunk.

- ``reservation(doc)``: the prompt estimated from its characters (no tokenizer on the hot path)
  plus the completion budget (``max_completion_tokens`` / ``max_tokens`` or a default), times
  the number of completions asked for.
- ``usage_from_body`` / ``UsageFilter``: the real figures, from a non-stream body or from the
  stream's usage chunk (``"choices": []`` with ``"usage"``).
- ``usage_plan`` / ``with_include_usage``: a stream only carries usage if the client asks
  (``stream_options.include_usage``); the gateway asks on the client's behalf and then removes
  that chunk before the client sees it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Final

from gateway.request.body import with_field

_MESSAGE_OVERHEAD_TOKENS: Final = 4  # role and separators of the chat template, per message
# Where the text of the other endpoints' bodies is (``gateway.request.endpoints``): the input of an
# embeddings, pooling or Responses request, the query and documents of a score or rerank one.
_TEXT_FIELDS: Final = (
    "input", "query", "documents", "queries", "items", "text_1", "text_2", "data_1", "data_2",
    "instructions", "texts",
)  # fmt: skip
_MAX_DEPTH: Final = 4
_NON_TEXT_PART_TOKENS: Final = 512  # an image or audio part: its bytes say nothing useful
_MAX_CHOICES: Final = 128
_USAGE: Final = b'"usage"'
_BOUNDARY: Final = re.compile(rb"\r\n\r\n|\n\n|\r\r")


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def _text_chars(content: Any) -> tuple[int, int]:
    """(characters, extra tokens) of a message content: a string or a list of parts."""
    if isinstance(content, str):
        return len(content), 0
    chars = extra = 0
    if isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                chars += len(part)
            elif isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    chars += len(text)
                else:
                    extra += _NON_TEXT_PART_TOKENS
    return chars, extra


def _prompt_chars(prompt: Any) -> tuple[int, int, int]:
    """(characters, token ids, prompts) of a completions ``prompt``."""
    if isinstance(prompt, str):
        return len(prompt), 0, 1
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) for p in prompt):
            return 0, len(prompt), 1
        chars = ids = 0
        for p in prompt:
            if isinstance(p, str):
                chars += len(p)
            elif isinstance(p, list):
                ids += len(p)
        return chars, ids, len(prompt)
    return 0, 0, 1


def _count(value: Any, depth: int = 0) -> tuple[int, int]:
    """(characters, tokens) of a text field: strings, token ids, lists and parts of them."""
    if isinstance(value, str):
        return len(value), 0
    if isinstance(value, bool) or depth > _MAX_DEPTH:
        return 0, 0
    if isinstance(value, int):
        return 0, 1  # a token id
    if isinstance(value, list):
        chars = tokens = 0
        for item in value:
            c, t = _count(item, depth + 1)
            chars, tokens = chars + c, tokens + t
        return chars, tokens
    if isinstance(value, dict):  # a part ({"type": "input_text", "text": ...}) or a message
        text = value.get("text", value.get("content"))
        return (0, _NON_TEXT_PART_TOKENS) if text is None else _count(text, depth + 1)
    return 0, 0


def estimate_prompt_tokens(doc: dict[str, Any], chars_per_token: float = 4.0) -> int:
    """Prompt tokens guessed from characters (chars / chars_per_token, rounded up)."""
    chars = 0
    extra = 0
    for name in _TEXT_FIELDS:
        if name in doc:
            c, t = _count(doc[name])
            chars, extra = chars + c, extra + t
    messages = doc.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, dict):
                continue
            extra += _MESSAGE_OVERHEAD_TOKENS
            c, e = _text_chars(m.get("content"))
            chars += c
            extra += e
            for field in ("name", "reasoning_content"):
                v = m.get(field)
                if isinstance(v, str):
                    chars += len(v)
            if m.get("tool_calls"):
                chars += len(json.dumps(m["tool_calls"]))
    else:
        c, ids, _ = _prompt_chars(doc.get("prompt"))
        chars += c
        extra += ids
    for field in ("tools", "functions", "response_format"):
        if doc.get(field):
            chars += len(json.dumps(doc[field]))
    return math.ceil(chars / chars_per_token) + extra


def _positive_int(v: Any) -> int | None:
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    return None


def completion_budget(doc: dict[str, Any], default_max_tokens: int) -> int:
    """Completion tokens the request may generate, over all its choices and prompts."""
    per_choice = (
        _positive_int(doc.get("max_completion_tokens"))
        or _positive_int(doc.get("max_tokens"))
        or _positive_int(doc.get("max_output_tokens"))  # the Responses API's name
        or default_max_tokens
    )
    n = max(_positive_int(doc.get("n")) or 1, _positive_int(doc.get("best_of")) or 1)
    prompts = 1 if "messages" in doc else _prompt_chars(doc.get("prompt"))[2]
    return per_choice * min(n * prompts, _MAX_CHOICES)


def reservation(
    doc: dict[str, Any],
    *,
    default_max_tokens: int = 1024,
    chars_per_token: float = 4.0,
    generates: bool = True,
) -> int:
    """Tokens to reserve at admission: prompt estimate plus completion budget (none for an
    endpoint that generates nothing: embeddings, scoring, tokenizing)."""
    prompt = estimate_prompt_tokens(doc, chars_per_token)
    return prompt + (completion_budget(doc, default_max_tokens) if generates else 0)


def _usage_of(doc: Any) -> Usage | None:
    if not isinstance(doc, dict):
        return None
    u = doc.get("usage")
    if not isinstance(u, dict):
        return None
    # Chat, completions and pooling say prompt/completion; Responses and Messages input/output.
    prompt = u.get("prompt_tokens", u.get("input_tokens"))
    completion = u.get("completion_tokens", u.get("output_tokens"))
    if prompt is None and completion is None:  # not in tokens (a transcription's seconds)
        return None
    prompt = prompt if isinstance(prompt, int) else 0
    completion = completion if isinstance(completion, int) else 0
    if "prompt_tokens" not in u:  # Anthropic's input_tokens leaves out the cached part
        for cached in ("cache_read_input_tokens", "cache_creation_input_tokens"):
            n = u.get(cached)
            prompt += n if isinstance(n, int) else 0
    total = u.get("total_tokens")
    return Usage(prompt, completion, total if isinstance(total, int) else prompt + completion)


def usage_from_body(body: bytes) -> Usage | None:
    """The ``usage`` of a non-stream response body, if it has one."""
    if _USAGE not in body:
        return None
    try:
        return _usage_of(json.loads(body))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class UsagePlan:
    inject: bool  # send the request upstream with stream_options.include_usage = true
    strip: bool  # remove the usage chunk from the stream before the client sees it


def usage_plan(doc: dict[str, Any]) -> UsagePlan:
    if doc.get("stream") is not True:
        return UsagePlan(inject=False, strip=False)  # a non-stream body always has usage
    so = doc.get("stream_options")
    asked = isinstance(so, dict) and so.get("include_usage") is True
    return UsagePlan(inject=not asked, strip=not asked)


def with_include_usage(doc: dict[str, Any], raw: bytes | None = None) -> bytes:
    """The request body to send upstream, asking for the usage chunk.

    Given the raw body of a request without ``stream_options``, the option is appended to it
    as bytes: a long prompt is not serialised again.
    """
    if raw is not None and "stream_options" not in doc:
        return with_field(doc, raw, "stream_options", {"include_usage": True})
    so = doc.get("stream_options")
    options = dict(so) if isinstance(so, dict) else {}
    options["include_usage"] = True
    return json.dumps({**doc, "stream_options": options}, separators=(",", ":")).encode()


def _data_of(event: bytes) -> bytes:
    lines = []
    for line in event.splitlines():
        if line.startswith(b"data:"):
            v = line[5:]
            lines.append(v[1:] if v.startswith(b" ") else v)
    return b"\n".join(lines)


class UsageFilter:
    """Reads the usage chunk of an OpenAI stream, and removes it when ``strip`` is set.

    Cheap: only events containing ``"usage"`` are parsed. ``event()`` takes one complete event
    (its bytes up to and including the blank line); ``feed()`` takes raw reads split anywhere.
    Without ``strip`` every read is returned as is, at once; with it, a read is returned up to
    its last complete event (the rest follows with the next read, or ``flush()``).
    """

    __slots__ = ("_tail", "strip", "usage")

    def __init__(self, *, strip: bool) -> None:
        self.strip = strip
        self.usage: Usage | None = None
        self._tail = b""

    def event(self, raw: bytes) -> bytes:
        """The event to send on (``raw`` itself), or ``b""`` when it is removed."""
        if raw.find(_USAGE) < 0:
            return raw
        try:
            doc = json.loads(_data_of(raw))
        except ValueError:
            return raw
        usage = _usage_of(doc)
        if usage is None:
            return raw
        self.usage = usage
        if self.strip and doc.get("choices") == []:
            return b""
        return raw

    def feed(self, chunk: bytes) -> bytes:
        # The usual read: whole events, none with usage (two C-level checks; ``find``, as
        # ``bytes in bytes`` first tries the operand as an int and clears the TypeError)
        if not self._tail and chunk.endswith(b"\n\n") and chunk.find(_USAGE) < 0:
            return chunk
        data = self._tail + chunk if self._tail else chunk
        end = _last_boundary(data)
        complete, self._tail = data[:end], data[end:]
        at = complete.find(_USAGE)
        if at < 0:
            return complete if self.strip else chunk
        # Only the events that name "usage" are parsed (a read may hold a whole answer).
        kept: list[bytes] = []
        done = 0  # where the bytes not yet kept begin
        while at >= 0:
            start = _last_boundary(complete, at)
            found = _BOUNDARY.search(complete, at)
            stop = found.end() if found is not None else len(complete)
            if not self.event(complete[start:stop]):  # removed (strip only)
                kept.append(complete[done:start])
                done = stop
            at = complete.find(_USAGE, stop)
        if not self.strip:
            return chunk
        if not kept:
            return complete
        kept.append(complete[done:])
        return b"".join(kept)

    def flush(self) -> bytes:
        """What is left at the end of the stream (an unterminated event), unfiltered."""
        tail, self._tail = self._tail, b""
        return tail if self.strip else b""


def _last_boundary(data: bytes, before: int | None = None) -> int:
    """Where the last event boundary in ``data`` (before ``before``) ends; 0 if none."""
    end = 0
    stop = len(data) if before is None else before
    for sep in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        i = data.rfind(sep, 0, stop)
        if i >= 0:
            end = max(end, i + len(sep))
    return end
