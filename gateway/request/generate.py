"""vLLM's token-in, token-out route (``/inference/v1/generate``), as the gateway reads it. Pure.

The body is token ids and sampling parameters: ``{"model", "token_ids": [...],
"sampling_params": {"max_tokens", "n", "min_tokens", ...}, "stream", "stream_options",
"request_id", "cache_salt", ...}``; the answer carries ``token_ids`` per choice (and text with
``output_mode: "text"``), a stream ends with a usage chunk (asked for) and ``[DONE]``. RL and
agent frameworks use it to keep tokenization on their side. vLLM serves it only when started
with ``--enable-scale-out`` (a 403 otherwise, ``gateway.request.endpoints``).

``generate_view`` is the body as the rest of the gateway reads a completion: the prompt (the
token ids, which precise prefix routing takes as they are: no tokenizing), the completion
budget, the number of choices. A broken stream is continued with the prompt plus the ids
already sent (``generate_resume_body``), exactly. ``Generations`` keeps who runs which id, for
the abort route (``gateway.request.aborts``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

from gateway.request.continuation import Progress, budget_left, is_int

if TYPE_CHECKING:
    from gateway.request.record import RequestRecord

_ENGINE_PREFIX: Final = "generate-tokens-"  # how vLLM names a generate request's engine id


def token_ids(doc: Mapping[str, Any]) -> list[int] | None:
    """The prompt's token ids (None when the body has none a prompt could be)."""
    ids = doc.get("token_ids")
    if isinstance(ids, list) and ids and all(is_int(i) for i in ids):
        return ids
    return None


def _sampling(doc: Mapping[str, Any]) -> dict[str, Any]:
    sp = doc.get("sampling_params")
    return sp if isinstance(sp, dict) else {}


def generate_view(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The body as a completion's: ``prompt`` (the ids), ``max_tokens``, ``n``, ``stream``."""
    sp = _sampling(doc)
    out: dict[str, Any] = {k: doc[k] for k in ("model", "stream", "cache_salt") if k in doc}
    ids = token_ids(doc)
    if ids is not None:
        out["prompt"] = ids
    for k in ("max_tokens", "n"):
        if k in sp:
            out[k] = sp[k]
    return out


def generate_refusal(doc: Mapping[str, Any]) -> str | None:
    """Why a stream of this request could not be continued exactly (None: it can be)."""
    if doc.get("stream") is not True:
        return "not_stream"
    if token_ids(doc) is None:
        return "prompt"
    sp = _sampling(doc)
    if sp.get("n") not in (None, 1):
        return "n"
    if sp.get("logprobs") is not None or sp.get("prompt_logprobs") is not None:
        return "logprobs"
    if sp.get("structured_outputs") is not None or sp.get("guided_decoding") is not None:
        return "structured_output"
    if doc.get("features") is not None:
        return "multimodal"
    return None


def generate_resume_body(doc: dict[str, Any], progress: Progress, generated: int) -> dict[str, Any]:
    """The request for the rest: the prompt followed by the ids sent, the budget lowered."""
    ids = progress.exact_ids or []
    body = {**doc, "token_ids": [*(token_ids(doc) or []), *ids]}
    body["sampling_params"] = {**_sampling(doc), **budget_left(_sampling(doc), True, generated)}
    so = doc.get("stream_options")
    body["stream_options"] = {**(so if isinstance(so, dict) else {}), "include_usage": True}
    body.pop("kv_transfer_params", None)
    return body


def abort_ids(request_id: str) -> tuple[str, str]:
    """The ids a generation sent upstream as ``request_id`` can be aborted by."""
    return request_id, _ENGINE_PREFIX + request_id


class Generations:
    """The generate requests in flight through this process: id -> (owner, its record).

    Bounded by the requests in flight: each is added when it starts, removed when it ends.
    """

    def __init__(self) -> None:
        self._by_id: dict[str, tuple[str, RequestRecord]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def started(self, ids: Iterable[str], owner: str, record: RequestRecord) -> None:
        for i in ids:
            self._by_id[i] = (owner, record)

    def ended(self, ids: Iterable[str]) -> None:
        for i in ids:
            self._by_id.pop(i, None)

    def placed(self, ids: Iterable[str], owner: str) -> tuple[dict[str, list[str]], list[str]]:
        """The caller's ids by the backends they were sent to, and the ids it does not own
        here (unknown, or another's)."""
        where: dict[str, list[str]] = {}
        unknown: list[str] = []
        for i in ids:
            held = self._by_id.get(i)
            if held is None or held[0] != owner or not held[1].backends:
                unknown.append(i)
                continue
            for backend in dict.fromkeys(held[1].backends):
                where.setdefault(backend, []).append(i)
        return where, unknown
