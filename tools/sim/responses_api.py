"""The OpenAI Responses API as vLLM 0.32 serves it, for a plain-text model. Pure.

``/v1/responses`` takes ``input`` (a string, or items with ``role`` and ``content``) and
``instructions``, ``max_output_tokens``, ``stream``, ``store`` (default true: the finished
response is kept, in this server's memory only, for ``GET /v1/responses/{id}`` and as a
``previous_response_id``) and vLLM's ``request_id`` (the response's id; default
``resp_<16 hex>``). A stream is named events (``event: <type>`` then ``data: <json>``, with
``type`` and ``sequence_number``), no ``[DONE]``: response.created, response.in_progress,
output_item.added, content_part.added, output_text.delta per token, output_text.done,
content_part.done, output_item.done, response.completed (the whole response, with usage as
``input_tokens``/``output_tokens``). Shapes from ``vllm/entrypoints/openai/responses/``.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from tools.sim.protocol import ApiError
from tools.sim.responses import named_event

STORE_CAPACITY: Final = 10_000  # vLLM keeps them all (its FIXME); the simulator, the newest


def new_id() -> str:
    return f"resp_{uuid.uuid4().hex[:16]}"


def not_found(response_id: str, param: str = "response_id") -> ApiError:
    # vLLM's store errors are typed invalid_request_error, not NotFoundError
    return ApiError(
        404, f"Response with id '{response_id}' not found.", param, "invalid_request_error"
    )


def chat_messages(body: dict[str, Any], previous: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat messages: the previous response's, instructions, input."""
    messages = list(previous)
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for item in given:
            if not isinstance(item, dict):
                raise ApiError(400, "1 validation error: input: Input should be a list of items")
            content = item.get("content")
            if isinstance(content, list):  # [{"type": "input_text", "text": ...}]
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            messages.append({"role": str(item.get("role", "user")), "content": content or ""})
    else:
        raise ApiError(400, "1 validation error: input: Field required", "input")
    return messages


@dataclass(slots=True)
class Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation including this answer


@dataclass(slots=True)
class ResponseStore:
    """The server's memory of finished responses (bounded; the newest kept)."""

    items: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self.items[response["id"]] = Stored(response, messages)
        self.items.move_to_end(response["id"])
        while len(self.items) > STORE_CAPACITY:
            self.items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> Stored:
        found = self.items.get(response_id)
        if found is None:
            raise not_found(response_id, param)
        return found


class ResponseBody:
    """Every body of one Responses request: the whole response, or its events."""

    __slots__ = ("created", "id", "input_tokens", "item_id", "model", "params", "seq")

    def __init__(
        self, response_id: str, model: str, input_tokens: int, params: dict[str, Any]
    ) -> None:
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.input_tokens = input_tokens
        self.item_id = f"msg_{uuid.uuid4().hex[:16]}"
        self.params = params
        self.seq = 0

    def response(self, text: str | None, output_tokens: int, status: str) -> dict[str, Any]:
        output = []
        if text is not None:
            output.append(self._message(text, "completed"))
        done = status != "in_progress"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": output,
            "instructions": self.params.get("instructions"),
            "max_output_tokens": self.params.get("max_output_tokens"),
            "previous_response_id": self.params.get("previous_response_id"),
            "store": self.params.get("store", True),
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "usage": (
                {
                    "input_tokens": self.input_tokens,
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens": output_tokens,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": self.input_tokens + output_tokens,
                }
                if done
                else None
            ),
        }

    def _message(self, text: str, status: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.item_id,
            "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}],
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        doc = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return named_event(kind, doc)

    def opening(self) -> Iterator[bytes]:
        started = self.response(None, 0, "in_progress")
        yield self.event("response.created", response=started)
        yield self.event("response.in_progress", response=started)
        item = {**self._message("", "in_progress"), "content": []}
        yield self.event("response.output_item.added", output_index=0, item=item)
        part: dict[str, Any] = {
            "type": "output_text",
            "text": "",
            "annotations": [],
            "logprobs": None,
        }
        yield self.event(
            "response.content_part.added",
            item_id=self.item_id,
            output_index=0,
            content_index=0,
            part=part,
        )

    def delta(self, text: str) -> bytes:
        return self.event(
            "response.output_text.delta",
            item_id=self.item_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def closing(self, full: dict[str, Any], text: str) -> Iterator[bytes]:
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield self.event("response.output_text.done", **where, text=text, logprobs=[])
        part: dict[str, Any] = {
            "type": "output_text",
            "text": text,
            "annotations": [],
            "logprobs": None,
        }
        yield self.event("response.content_part.done", **where, part=part)
        item = self._message(text, "completed")
        yield self.event("response.output_item.done", output_index=0, item=item)
        yield self.event("response.completed", response=full)
