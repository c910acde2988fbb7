"""vLLM 0.32's scale-out endpoints (``vllm/entrypoints/scale_out``), a prompt rendered apart
from its generation. Pure: bodies in, documents and events out.

Without ``--enable-scale-out`` every one of them answers 403 (``FORBIDDEN``), as vLLM's do.
With it:

- ``/v1/chat/completions/render``, ``/v1/messages/render`` (one document) and
  ``/v1/completions/render`` (a list of one) answer vLLM's ``GenerateRequest``: the prompt's
  ``token_ids``, its ``sampling_params`` (vLLM's ``SamplingParams`` as it serialises them,
  default-valued fields left out), ``request_id`` (``chatcmpl-...``/``cmpl-...``),
  ``model``, ``stream``, ``stream_options`` and the rest null or default. Post it as it is
  to ``/inference/v1/generate``.
- ``/inference/v1/generate`` takes ``token_ids`` and ``sampling_params`` (``max_tokens``,
  default the room left in the context; ``seed``, ``ignore_eos``, ``stop``; the rest
  accepted), ``stream``, ``stream_options``, ``output_mode`` (``tokens``, or ``text`` to
  add the text), ``return_token_ids``, ``request_id``, and runs them on the engine like
  any request. Its answer is ``generate-tokens-<request_id>`` with ``choices[0].token_ids``
  (the EOS token's id included) and ``usage``; a stream is ``data:`` chunks of one token
  each (every field written, nulls too), the ``include_usage`` chunk, ``[DONE]``.
- ``/inference/v1/abort_requests`` ``{"request_ids": [...]}`` aborts generate requests by
  that id: their answer ends with ``finish_reason`` ``abort``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from tools.sim.config import SimConfig
from tools.sim.engine import TokenEvent
from tools.sim.priority import read_priority
from tools.sim.protocol import ApiError, GenerateParams, Outcome, error_envelope, parse_stop
from tools.sim.responses import DONE, ENGINE_ERROR, sse, usage
from tools.sim.tokens import OutputText
from tools.sim.validation import Fields, Problems, as_int

FORBIDDEN: Final = error_envelope(
    403,
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.",
    kind="PermissionDeniedError",
)
# Every scale-out route vLLM registers (403 when disabled); the simulator serves the
# render and token-in-token-out ones, not /v1/responses/render nor the derender routes.
ROUTES: Final = (
    "/v1/chat/completions/render",
    "/v1/messages/render",
    "/v1/completions/render",
    "/v1/responses/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/inference/v1/generate",
    "/inference/v1/abort_requests",
)
_GREEDY: Final = 1e-5  # vLLM's _SAMPLING_EPS: below it, sampling is greedy
_OUTPUT_KIND: Final = {True: 1, False: 2}  # RequestOutputKind.DELTA, FINAL_ONLY


def sampling_params(
    *,
    max_tokens: int,
    stream: bool,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: tuple[str, ...] = (),
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """vLLM's ``SamplingParams`` as its render endpoints serialise them (msgspec, default
    fields omitted; greedy sampling drops ``top_p``, ``top_k`` and ``min_p``)."""
    doc: dict[str, Any] = {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }
    doc["temperature"] = t = 1.0 if temperature is None else float(temperature)
    if t >= _GREEDY:
        doc["top_p"] = 1.0 if top_p is None else float(top_p)
        if top_k:
            doc["top_k"] = int(top_k)
        doc["min_p"] = 0.0
    if seed is not None:
        doc["seed"] = seed
    doc["stop"] = list(stop)
    doc["stop_token_ids"] = []
    if ignore_eos:
        doc["ignore_eos"] = True
    doc["max_tokens"] = max_tokens
    doc["output_kind"] = _OUTPUT_KIND[stream]
    doc["skip_clone"] = True
    hold = max((len(s) for s in stop), default=0) - 1
    if hold > 0:
        doc["output_text_buffer_length"] = hold  # text held back for stop strings
    doc["bad_words"] = []
    doc["skip_reading_prefix_cache"] = False
    return doc


def render_max_tokens(params: GenerateParams, config: SimConfig) -> int:
    """vLLM's ``get_max_tokens`` for a rendered prompt: the request's, within the room left."""
    n, limit = len(params.prompt_ids), config.max_model_len
    if n > limit:
        raise ApiError(400, f"Input length ({n}) exceeds model's maximum context length ({limit}).")
    room = limit - n
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    return max_tokens


def number(body: dict[str, Any], key: str) -> Any:
    """A sampling parameter of a chat or completion body, if it is a number (the simulator's
    chat checks no sampling parameter's type)."""
    value = body.get(key)
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def render_doc(
    request_id: str,
    token_ids: tuple[int, ...],
    sampling: dict[str, Any],
    *,
    model: str | None,
    stream: bool,
    stream_options: dict[str, Any] | None,
    cache_salt: str | None = None,
    priority: int = 0,
) -> dict[str, Any]:
    """vLLM's ``GenerateRequest``, as its render endpoints answer it."""
    return {
        "request_id": request_id,
        "token_ids": list(token_ids),
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": sampling,
        "model": model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": stream,
        "stream_options": stream_options if stream else None,
        "cache_salt": cache_salt,
        "priority": priority,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def stream_options(given: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's ``StreamOptions`` as dumped (both fields, false by default)."""
    if given is None:
        return None
    return {
        "include_usage": bool(given.get("include_usage")),
        "continuous_usage_stats": bool(given.get("continuous_usage_stats")),
    }


@dataclass(frozen=True, slots=True)
class TokensRequest:
    """A valid ``/inference/v1/generate`` body."""

    request_id: str | None  # None: a new one
    params: GenerateParams
    text_mode: bool  # output_mode "text": the text too
    return_token_ids: bool
    priority: int = 0


def parse_tokens_request(body: Any) -> TokensRequest:
    """Validate a generate body as vLLM's ``GenerateRequest`` (``BodyError``, or vLLM's
    ``SamplingParams`` errors) and read it as the simulator's request."""
    f = Fields.body(body)
    request_id = f.string("request_id")
    token_ids = _token_ids(f)
    sampling = _sampling(f)
    model = f.string("model")
    f.boolean("reasoning_ended")
    return_ids = bool(f.boolean("return_token_ids"))
    mode = f.literal("output_mode", ("tokens", "text"))
    stream = bool(f.boolean("stream"))
    options = None
    raw_options = f.doc.get("stream_options")
    if raw_options is not None:
        o = f.nested(("stream_options",), raw_options)
        if o is not None:
            options = {k: o.boolean(k) for k in ("include_usage", "continuous_usage_stats")}
    f.string("cache_salt")
    priority = read_priority(f)
    kv = f.mapping("kv_transfer_params")
    f.problems.check()
    assert token_ids is not None  # else a problem was raised
    assert sampling is not None
    max_tokens = sampling.integer("max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    n = sampling.integer("n")
    if n not in (None, 1):
        raise ApiError(400, "The simulator supports n=1 only.", "n")
    options = options or {}
    params = GenerateParams(
        chat=False,
        model=model,
        prompt_ids=token_ids,
        echo_words=(),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=stream and bool(options.get("include_usage")),
        continuous_usage_stats=stream and bool(options.get("continuous_usage_stats")),
        ignore_eos=bool(sampling.boolean("ignore_eos")),
        seed=sampling.integer("seed"),
        kv_transfer_params=kv,
        stop=parse_stop(sampling.doc.get("stop"), "sampling_params.stop"),
    )
    return TokensRequest(request_id, params, mode == "text", return_ids, priority)


def _token_ids(f: Fields) -> tuple[int, ...] | None:
    raw = f.array("token_ids", required=True)
    if raw is None:
        return None
    if not raw:
        f.error(
            "token_ids",
            "too_short",
            "List should have at least 1 item after validation, not 0",
            raw,
            field_type="List",
            min_length=1,
            actual_length=0,
        )
        return None
    items = Fields(f.doc, (*f.loc, "token_ids"), f.problems)
    ids = [as_int(items, i, t) for i, t in enumerate(raw)]
    if any(i is None for i in ids):
        return None
    good = tuple(i for i in ids if i is not None)
    if any(i < 0 for i in good):
        f.value_error("token_ids", "token_ids must not contain negative values", raw)
        return None
    return good


def _sampling(f: Fields) -> Fields | None:
    """``sampling_params``: pydantic reports a bad one as not a SamplingParams, then why."""
    if "sampling_params" not in f.doc:
        f.problems.add("missing", (*f.loc, "sampling_params"), "Field required", f.doc)
        return None
    value = f.doc["sampling_params"]
    inner = Problems()
    fields = Fields(value, (*f.loc, "sampling_params"), inner) if isinstance(value, dict) else None
    if fields is None:
        where = (*f.loc, "sampling_params")
        inner.add("dict_type", where, "Input should be a valid dictionary", value)
    else:
        for key in ("n", "top_k", "seed", "max_tokens", "min_tokens"):
            fields.integer(key)
        for key in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            fields.number(key)
        fields.boolean("ignore_eos")
        stop = fields.doc.get("stop")
        if stop is not None and not isinstance(stop, str):
            fields.strings("stop")
    if not inner.items:
        return fields
    f.error(
        "sampling_params",
        "is_instance_of",
        "Input should be an instance of SamplingParams",
        value,
        **{"class": "SamplingParams"},
    )
    f.problems.items += inner.items
    return None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """vLLM's ``UsageInfo``, every field written."""
    return {
        **usage(prompt_tokens, completion_tokens),
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


class TokensAnswer:
    """Every body of one ``/inference/v1/generate`` request: the whole response, or its
    stream's chunks (a ``StreamFormat``)."""

    __slots__ = (
        "continuous",
        "details",
        "id",
        "include_usage",
        "output",
        "prompt_ids",
        "prompt_sent",
        "text_mode",
    )

    def __init__(
        self,
        response_id: str,
        req: TokensRequest,
        output: OutputText,
        *,
        details: bool,
    ) -> None:
        self.id = response_id
        self.output = output
        self.text_mode = req.text_mode
        self.prompt_ids = req.params.prompt_ids
        self.prompt_sent = not req.return_token_ids  # the prompt's ids go with the first chunk
        self.include_usage = req.params.include_usage
        self.continuous = req.params.continuous_usage_stats
        self.details = details  # --enable-prompt-tokens-details

    @property
    def mode(self) -> str:
        return "text" if self.text_mode else "tokens"

    def _choice(self, finish_reason: str | None, token_ids: list[int], text: str) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": finish_reason,
            "stop_reason": None if finish_reason is None else self.output.stop_reason,
            "token_ids": token_ids,
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": None,
        }
        if self.text_mode:
            choice["text"] = text
        choice["logprobs"] = None
        return choice

    def full(
        self, end: Outcome, created: int, model: str, kv: dict[str, Any] | None
    ) -> dict[str, Any]:
        n = end.tokens
        ids = [self.output.token_id(i) for i in range(n)]
        reason = end.finish_reason or "stop"
        use = _usage(len(self.prompt_ids), n)
        if self.details:
            use["prompt_tokens_details"] = end.prompt_details(created=False, whole=True)
        return {
            "request_id": self.id,
            "model": model,
            "created": created,
            "usage": use,
            "prompt_logprobs": None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": None if self.prompt_sent else list(self.prompt_ids),
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": kv,
            "ec_transfer_params": None,
            "output_mode": self.mode,
            "choices": [self._choice(reason, ids, self.output.text(n))],
        }

    def _chunk(self, choice: dict[str, Any], completion_tokens: int) -> bytes:
        chunk: dict[str, Any] = {"request_id": self.id}
        chunk["usage"] = (
            _usage(len(self.prompt_ids), completion_tokens) if self.continuous else None
        )
        if not self.prompt_sent:
            chunk["prompt_token_ids"] = list(self.prompt_ids)
            self.prompt_sent = True
        chunk["output_mode"] = self.mode
        chunk["choices"] = [choice]
        return sse(chunk)

    # -- the stream

    def opening(self) -> list[bytes]:
        return []

    def token(self, event: TokenEvent) -> bytes:
        index = event.index
        choice = self._choice(
            event.finish_reason, [self.output.token_id(index)], self.output.piece(index)
        )
        return self._chunk(choice, index + 1)

    def closing(self, end: Outcome) -> list[bytes]:
        parts = []
        if end.finish_reason == "abort":  # vLLM's terminal output: no token, the reason
            parts.append(self._chunk(self._choice("abort", [], ""), end.tokens))
        if self.include_usage:
            use: dict[str, Any] = usage(len(self.prompt_ids), end.tokens)
            if self.details:
                use["prompt_tokens_details"] = {"cached_tokens": end.cached_tokens}
            final = {"request_id": self.id, "usage": use, "output_mode": self.mode, "choices": []}
            parts.append(sse(final))
        parts.append(DONE)
        return parts

    def failure(self) -> list[bytes]:
        return [ENGINE_ERROR, DONE]
