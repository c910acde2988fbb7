"""Continuing a stream on another backend when its own fails mid-way. Pure: bytes and JSON.

When a stream breaks after bytes reached the client, the gateway asks another backend for the
rest of the answer: the prompt followed by what was already generated, the budget lowered by
it (``resume_body``), and relays that answer as if it were the same stream (``Stitch``). Four
parts:

- ``refusal(doc, path)``: whether a request can be continued faithfully at all (decided once,
  before it is sent: ``n > 1``, ``echo``, ``logprobs``, structured output... cannot).
- ``Keep``: what the relay keeps of a healthy stream, at the cost of an append per read: the
  reads as sent to the client, whole events only (a read's unfinished last event waits for
  the rest of it), parsed only if the stream breaks, or once they pass ``compact_bytes``.
  It also stops a stream at an error event from the engine, before the client sees it.
- ``Progress``: what the client has received, read from those events: the stream's ``id``,
  ``created``, the text and (when the stream carries them) the token ids, whether it
  finished; and what would make a continuation unfaithful (a tool call, reasoning).
- ``Stitch``: the continuation's events rewritten into the client's stream: the first
  stream's ``id`` and ``created``, no second role chunk, usage covering the whole answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Protocol, TypeGuard, TypeVar

from gateway.request.sse import SSEParser

_BOUNDARY: Final = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_MAX_EVENT: Final = 1 << 20  # an unfinished event longer than this is not held back
# Cheap first look for an engine's error event (vLLM's ``{"error": ...}`` once a stream has
# begun; a finish_reason "error" is turned into one): a healthy read rarely contains it, and
# a false alarm only costs a parse of that read. An "abort" finish is passed on as vLLM gave
# it: the engine ended that request on purpose (an operator's abort, a pause).
_ERROR: Final = b'"error'
_ERROR_EVENT: Final = b'data: {"error"'
_NAMED_ERROR_EVENT: Final = b"event: error"  # a Messages stream's (Anthropic's shape)
_FAILED_FINISH: Final = frozenset({"error"})
_STRUCTURED: Final = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def refusal(doc: dict[str, Any], chat: bool) -> str | None:
    """Why a stream of this request could not be continued faithfully; None if it can be."""
    if doc.get("stream") is not True:
        return "not_stream"
    n = doc.get("n")
    if (n is not None and n != 1) or doc.get("best_of") not in (None, 1):
        return "n"
    if doc.get("echo"):
        return "echo"
    if doc.get("logprobs") or doc.get("top_logprobs"):
        return "logprobs"
    fmt = doc.get("response_format")
    if (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")) or any(
        doc.get(k) is not None for k in (*_STRUCTURED, "structured_outputs")
    ):
        return "structured_output"
    if chat:
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            return "prompt"
        return None
    if doc.get("suffix"):
        return "suffix"
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)
    ):
        return None
    return "prompt"  # a batch of prompts, or something vLLM will refuse anyway


def is_int(v: Any) -> TypeGuard[int]:
    """An int in JSON's sense (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(slots=True)
class Progress:
    """What one stream's client has received so far (choice 0; ``refusal`` ruled out others).

    ``blocker`` names what makes a faithful continuation impossible now (``tool_call``,
    ``reasoning``, ``choices``, ``unparsable``); None while one is possible.
    """

    chat: bool
    id: str | None = None
    created: int | None = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the generated ids events carried
    prompt_token_ids: list[int] | None = None
    prompt_tokens: int | None = None  # from a usage figure the stream carried, if any
    events: int = 0  # events that carried generated output (a lower bound on the tokens)
    finished: str | None = None  # the finish_reason, once seen
    done: bool = False  # [DONE] seen
    usage_seen: bool = False
    blocker: str | None = None
    _ids_missing: bool = False  # an output event carried no ids
    _parser: SSEParser = field(default_factory=SSEParser)

    def feed(self, data: bytes) -> None:
        """Whole events as the client received them."""
        for payload in self._parser.feed(data):
            self.observe(payload)

    @property
    def generated(self) -> str:
        return "".join(self.text)

    @property
    def exact_ids(self) -> list[int] | None:
        """The generated token ids, if every output event carried them."""
        return None if self._ids_missing else self.token_ids

    def observe(self, payload: bytes) -> dict[str, Any] | None:
        """Take one event's data; return its JSON object (None for [DONE] or non-JSON)."""
        if payload == b"[DONE]":
            self.done = True
            return None
        try:
            doc = json.loads(payload)
        except (ValueError, RecursionError):
            self.blocker = self.blocker or "unparsable"
            return None
        if not isinstance(doc, dict):
            return None
        self.take(doc)
        return doc

    def take(self, doc: dict[str, Any]) -> None:
        """Take one event's JSON object."""
        if self.id is None and isinstance(doc.get("id"), str):
            self.id = doc["id"]
        if self.created is None and is_int(doc.get("created")):
            self.created = doc["created"]
        if self.chat and isinstance(doc.get("prompt_token_ids"), list):
            self.prompt_token_ids = doc["prompt_token_ids"]
        usage = doc.get("usage")
        if isinstance(usage, dict):
            if is_int(usage.get("prompt_tokens")):
                self.prompt_tokens = usage["prompt_tokens"]
            if not doc.get("choices"):
                self.usage_seen = True
        choices = doc.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict):
                    self._choice(choice)

    def _choice(self, c: dict[str, Any]) -> None:
        if c.get("index", 0) != 0:
            self.blocker = self.blocker or "choices"
            return
        if not self.chat and isinstance(c.get("prompt_token_ids"), list):
            self.prompt_token_ids = c["prompt_token_ids"]
        if self.chat:
            delta = c.get("delta")
            output = isinstance(delta, dict) and self._delta(delta)
        else:
            text = c.get("text")
            output = isinstance(text, str)
            if isinstance(text, str):
                self.text.append(text)
        self._ids(c.get("token_ids"), output)
        if output:
            self.events += 1
        reason = c.get("finish_reason")
        if isinstance(reason, str):
            self.finished = reason

    def _delta(self, delta: dict[str, Any]) -> bool:
        """Take a chat delta; True if it carried output (its content, maybe empty)."""
        if delta.get("tool_calls"):
            self.blocker = self.blocker or "tool_call"
        if delta.get("reasoning") or delta.get("reasoning_content"):
            self.blocker = self.blocker or "reasoning"
        content = delta.get("content")
        if isinstance(content, str) and "role" not in delta:
            self.text.append(content)
            return True
        return False

    def _ids(self, ids: Any, output: bool) -> None:
        if isinstance(ids, list):
            self.token_ids.extend(i for i in ids if is_int(i))
        elif output:
            self._ids_missing = True  # the ids are not exact


class StreamProgress(Protocol):
    """What a stream's client has received, fed whole events by the relay (``Keep``) and read
    when the stream breaks (``Progress``; a Messages stream's,
    ``gateway.request.messages_resume.MessagesProgress``)."""

    @property
    def events(self) -> int:
        """Events that carried generated output (a lower bound on the tokens)."""
        ...

    @property
    def finished(self) -> str | None:
        """Why the generation finished, once the stream said it."""
        ...

    @property
    def done(self) -> bool:
        """The stream's last event was seen."""
        ...

    @property
    def generated(self) -> str:
        """The text sent so far."""
        ...

    @property
    def exact_ids(self) -> list[int] | None:
        """The generated token ids, if the stream carried every one."""
        ...

    def feed(self, data: bytes) -> None: ...


P = TypeVar("P", bound=StreamProgress)


class Keep(Generic[P]):
    """What the relay keeps of a stream so that it can be continued if it breaks.

    ``take(read)`` returns the bytes to send now: the read, less an unfinished last event
    (sent with the next read) and less anything from an engine's error event on, which sets
    ``cut`` to its message instead. The kept bytes are parsed into ``progress`` only when
    asked (``progress()``) or past ``compact_bytes``, so a healthy stream pays an append.
    """

    __slots__ = ("_compact", "_held", "_progress", "_reads", "_size", "cut")

    def __init__(self, progress: P, compact_bytes: int) -> None:
        self._progress = progress
        self._reads: list[bytes] = []
        self._size = 0
        self._compact = compact_bytes
        self._held = b""
        self.cut: str | None = None

    def take(self, data: bytes, events: int = -1) -> bytes:
        """``events``: how many events ``data`` holds, if the caller counted (-1: unknown)."""
        if self._held:
            data, self._held = self._held + data, b""
            events = -1
        if not data.endswith(b"\n\n"):  # the usual read is whole events: one check
            end = _last_boundary(data)
            if end < len(data) and len(data) - end <= _MAX_EVENT:
                data, self._held = data[:end], data[end:]
        # The usual read is one event, and an error event's first bytes say what it is.
        one = events == 1
        if data.startswith((_ERROR_EVENT, _NAMED_ERROR_EVENT)) if one else data.find(_ERROR) >= 0:
            data = self._until_failure(data)
        if data:
            self._reads.append(data)
            self._size += len(data)
            if self._size > self._compact:
                self._parse()
        return data

    def progress(self) -> P:
        """What the client has received (what is held back never reached it)."""
        self._parse()
        return self._progress

    def _parse(self) -> None:
        if self._reads:
            self._progress.feed(b"".join(self._reads))
            self._reads.clear()
            self._size = 0

    def _until_failure(self, data: bytes) -> bytes:
        """``data`` up to the first event saying the engine failed (``cut`` says how)."""
        start = 0
        for m in _BOUNDARY.finditer(data):
            failure = engine_failure(data[start : m.end()])
            if failure is not None:
                self.cut = failure
                self._held = b""
                return data[:start]
            start = m.end()
        return data


def _last_boundary(data: bytes) -> int:
    """The end of the last complete event in ``data`` (0 if there is none)."""
    return max(
        (m.end() for m in _BOUNDARY.finditer(data, max(0, len(data) - _MAX_EVENT))), default=0
    )


def engine_failure(event: bytes) -> str | None:
    """The message of an event in which the engine reports a failure: an ``error`` object
    (vLLM's way once a stream has begun) or an ``error`` finish. None for any other event
    (an ``abort`` finish included: it is the engine's answer, passed on as it gave it)."""
    for payload in SSEParser().feed(event if event.endswith(b"\n\n") else event + b"\n\n"):
        try:
            doc = json.loads(payload)
        except (ValueError, RecursionError):
            continue
        failure = failure_of(doc)
        if failure is not None:
            return failure
    return None


def failure_of(doc: Any) -> str | None:
    """``engine_failure`` for one event's parsed data."""
    if not isinstance(doc, dict):
        return None
    err = doc.get("error")
    if err is not None:
        message = err.get("message") if isinstance(err, dict) else err
        return f"the engine reported an error: {str(message)[:200]}"
    choices = doc.get("choices")
    for c in choices if isinstance(choices, list) else ():
        if isinstance(c, dict) and c.get("finish_reason") in _FAILED_FINISH:
            return f"the engine ended the generation ({c['finish_reason']})"
    return None


# -- the request that asks for the rest --------------------------------------------------


def budget_left(doc: dict[str, Any], chat: bool, generated: int) -> dict[str, int]:
    """The completion budget fields of the continuation: each lowered by ``generated``."""
    out: dict[str, int] = {}
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for key in keys:
        v = doc.get(key)
        if is_int(v):
            out[key] = max(1, v - generated)
    if not chat and "max_tokens" not in doc:
        out["max_tokens"] = max(1, 16 - generated)  # vLLM's completions default
    v = doc.get("min_tokens")
    if is_int(v):
        out["min_tokens"] = max(0, v - generated)
    return out


def resume_body(
    doc: dict[str, Any], chat: bool, progress: Progress, generated: int
) -> dict[str, Any]:
    """The request for the rest of the answer, given ``generated`` tokens already sent."""
    body = {**doc, **budget_left(doc, chat, generated)}
    so = doc.get("stream_options")
    options = dict(so) if isinstance(so, dict) else {}
    options["include_usage"] = True  # the stitched usage needs the continuation's figures
    body["stream_options"] = options
    body.pop("kv_transfer_params", None)  # a continuation is prefilled where it runs
    text = progress.generated
    if chat:
        messages = list(doc["messages"])
        last = messages[-1] if messages else None
        if doc.get("continue_final_message") and isinstance(last, dict):
            messages[-1] = {**last, "content": _appended(last.get("content"), text)}
        else:
            messages.append({"role": "assistant", "content": text})
        body["messages"] = messages
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
        return body
    prompt = doc["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    ids = progress.exact_ids
    if isinstance(prompt, list):  # token ids in, token ids out
        body["prompt"] = [*prompt, *(ids or [])]
    elif ids is not None and progress.prompt_token_ids is not None:
        body["prompt"] = [*progress.prompt_token_ids, *ids]
    else:
        body["prompt"] = prompt + text
    return body


def _appended(content: Any, text: str) -> Any:
    if isinstance(content, list):
        return [*content, {"type": "text", "text": text}]
    return (content if isinstance(content, str) else "") + text


def can_resume(doc: dict[str, Any], chat: bool, progress: Progress) -> str | None:
    """Why this stream cannot be continued now (None if it can)."""
    if progress.blocker is not None:
        return progress.blocker
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if not chat and isinstance(prompt, list) and progress.text and progress.exact_ids is None:
        return "token_prompt"  # a token-id prompt continued needs the generated ids
    return None


# -- the continuation's events, as the client's stream -----------------------------------


class Stitch:
    """Rewrites a continuation's events into the stream the client is reading.

    ``generated``: tokens of the answer already sent (the continuation's own usage counts
    only what it adds, and its prompt includes them). Every event it lets through is also
    fed to ``progress``, so a continuation that breaks in turn can be continued again.
    ``cut`` is set (and nothing more passes) at an event saying the engine failed.
    """

    __slots__ = ("_parser", "_prompt_tokens", "cut", "emitted", "generated", "progress")

    def __init__(self, progress: Progress, generated: int) -> None:
        self.progress = progress
        self.generated = generated
        self._prompt_tokens = progress.prompt_tokens
        self._parser = SSEParser()
        self.cut: str | None = None
        self.emitted = 0  # events passed on

    def feed(self, data: bytes) -> bytes:
        if self.cut is not None:
            return b""
        out: list[bytes] = []
        for payload in self._parser.feed(data):
            event = self._event(payload)
            if self.cut is not None:
                break
            if event is not None:
                out.append(event)
                self.emitted += 1
        return b"".join(out)

    def _event(self, payload: bytes) -> bytes | None:
        if payload == b"[DONE]":
            self.progress.done = True
            return b"data: [DONE]\n\n"
        try:
            doc = json.loads(payload)
        except (ValueError, RecursionError):
            return None  # nothing a client could use
        failure = failure_of(doc)
        if failure is not None:
            self.cut = failure
            return None
        if not isinstance(doc, dict):
            return None
        p = self.progress
        if p.id is not None:
            doc["id"] = p.id
        if p.created is not None:
            doc["created"] = p.created
        doc.pop("prompt_token_ids", None)
        choices = doc.get("choices")
        if isinstance(choices, list):
            for c in choices:
                if isinstance(c, dict):
                    c.pop("prompt_token_ids", None)
            if p.chat and _role_only(choices):
                return None  # the client has had its role chunk
        usage = doc.get("usage")
        if isinstance(usage, dict):
            doc["usage"] = self._usage(usage)
        p.take(doc)
        return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if not is_int(prompt) or not is_int(completion):
            return usage
        if self._prompt_tokens is None:  # the continuation's prompt less the answer sent
            self._prompt_tokens = max(0, prompt - self.generated)
        completion += self.generated
        return {
            **usage,
            "prompt_tokens": self._prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self._prompt_tokens + completion,
        }


def _role_only(choices: list[Any]) -> bool:
    """A chat stream's opening chunk: a role, empty content, no finish."""
    if len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    c = choices[0]
    delta = c.get("delta")
    return (
        isinstance(delta, dict)
        and "role" in delta
        and not delta.get("content")
        and not delta.get("tool_calls")
        and c.get("finish_reason") is None
    )
