"""OpenAI request bodies, as vLLM 0.32 reads them: validation in, plain values out.

Pure: a parsed JSON body goes in, a ``GenerateParams`` (or a ``TokenizeParams`` for
``/tokenize``, or an ``ApiError`` carrying vLLM's status, type and message) comes out.
Sampling parameters the simulator does not model (temperature, top_p, ...) are accepted
and ignored; ``stop`` strings end the answer as vLLM's do (``tokens.cut_at_stops``). A
chat's ``add_generation_prompt`` and ``continue_final_message`` shape its prompt as vLLM's
do (both true is a 400), so a partial assistant message is continued from where it stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final

from gateway.tokenizer.words import message_text, render_chat, tokenize
from tools.sim.config import SimConfig
from tools.sim.tokens import OutputText, cut_at_stops, mix64, natural_length, prompt_seed

COMPLETIONS_DEFAULT_MAX_TOKENS: Final = 16  # OpenAI's and vLLM's default for /v1/completions
# What a decode instance needs from the prefill instance's kv_transfer_params (NIXL).
REMOTE_PREFILL_FIELDS: Final = (
    "remote_engine_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
)

_ERROR_TYPES: Final = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
}


class ApiError(Exception):
    """An error answered with vLLM's envelope ``{"error": {...}}``."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind  # the envelope's type, when not the status's usual one

    def envelope(self) -> dict[str, Any]:
        return error_envelope(self.status, self.message, self.param, self.kind)


def error_envelope(
    status: int, message: str, param: str | None = None, kind: str | None = None
) -> dict[str, Any]:
    kind = kind or _ERROR_TYPES.get(status)
    if kind is None:
        kind = HTTPStatus(status).phrase.replace(" ", "").replace("-", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """What the simulator needs from a completions or chat completions body."""

    chat: bool
    model: str | None
    prompt_ids: tuple[int, ...]
    echo_words: tuple[str, ...]
    max_tokens: int | None
    stream: bool
    include_usage: bool
    continuous_usage_stats: bool
    ignore_eos: bool
    seed: int | None
    kv_transfer_params: dict[str, Any] | None = None
    stop: tuple[str, ...] = ()

    @property
    def remote_decode(self) -> bool:
        """The prefill half of a disaggregated request: prefill, then hand the KV over."""
        kv = self.kv_transfer_params
        return kv is not None and bool(kv.get("do_remote_decode"))

    @property
    def remote_prefill(self) -> bool:
        """The decode half, with everything needed to pull the KV (else: a local prefill,
        as vLLM falls back to when the parameters are incomplete)."""
        kv = self.kv_transfer_params
        return (
            kv is not None
            and bool(kv.get("do_remote_prefill"))
            and all(kv.get(k) is not None for k in REMOTE_PREFILL_FIELDS)
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a request ended: its output tokens, finish reason (``abort`` if aborted on
    demand), and its prompt's prefix-cache figures (``engine.TokenEvent``'s)."""

    tokens: int
    finish_reason: str
    cached_tokens: int = 0
    created_tokens: int = 0

    def prompt_details(self, *, created: bool, whole: bool) -> dict[str, Any]:
        """vLLM's ``prompt_tokens_details`` (with ``--enable-prompt-tokens-details``): the
        cached tokens, and the created ones where the API reports them (chat); ``whole``
        as a whole response writes it, its unset fields null."""
        details: dict[str, Any] = {"cached_tokens": self.cached_tokens}
        if created:
            details["created_cache_tokens"] = self.created_tokens
        if whole:
            details.setdefault("created_cache_tokens", None)
            details["multimodal_tokens"] = None
        return details


@dataclass(frozen=True, slots=True)
class TokenizeParams:
    """What ``/tokenize`` needs: the text to tokenise (a chat already rendered)."""

    model: str | None
    text: str
    return_token_strs: bool


def parse_tokenize(body: Any) -> TokenizeParams:
    """Validate a ``/tokenize`` body, vLLM's completion form (``prompt``) or chat form
    (``messages``), raising ``ApiError(400)``. The simulator's tokenizer has no special
    tokens, so ``add_special_tokens`` is checked but changes nothing."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    model = _opt(body, "model", str)
    _opt(body, "add_special_tokens", bool)
    strs = bool(_opt(body, "return_token_strs", bool))
    if body.get("prompt") is not None or "messages" not in body:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            problem = "Field required" if prompt is None else "Input should be a valid string"
            raise ApiError(400, f"1 validation error: prompt: {problem}", "prompt")
        return TokenizeParams(model, prompt, strs)
    messages = _chat_messages(body)
    text = render_chat(messages, add_generation_prompt=_generation_prompt(body))
    return TokenizeParams(model, text, strs)


def parse_generate(body: Any, *, chat: bool) -> GenerateParams:
    """Validate a request body the way vLLM does, raising ``ApiError(400)``."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    model = _opt(body, "model", str)
    if chat:
        prompt_ids, words = _chat_prompt(body)
        max_tokens = _opt(body, "max_completion_tokens", int)
        if max_tokens is None:
            max_tokens = _opt(body, "max_tokens", int)
    else:
        prompt_ids, words = _completion_prompt(body)
        max_tokens = _opt(body, "max_tokens", int)
        if "max_tokens" not in body:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    n = _opt(body, "n", int)
    if n not in (None, 1):
        raise ApiError(400, "The simulator supports n=1 only.", "n")
    stream = bool(_opt(body, "stream", bool))
    options = _opt(body, "stream_options", dict)
    if options is not None and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.")
    options = options or {}
    return GenerateParams(
        chat=chat,
        model=model,
        prompt_ids=prompt_ids,
        echo_words=words,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(_opt(options, "include_usage", bool)),
        continuous_usage_stats=bool(_opt(options, "continuous_usage_stats", bool)),
        ignore_eos=bool(_opt(body, "ignore_eos", bool)),
        seed=_opt(body, "seed", int),
        kv_transfer_params=_opt(body, "kv_transfer_params", dict),
        stop=parse_stop(body.get("stop")),
    )


def parse_stop(value: Any, key: str = "stop") -> tuple[str, ...]:
    """A request's stop strings: a string or a list of strings (vLLM's ``stop``)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise ApiError(
        400, f"1 validation error: {key}: Input should be a string or a list of strings", key
    )


def _opt(body: dict[str, Any], key: str, kind: type[Any]) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ApiError(
            400,
            f"1 validation error: {key}: Input should be a valid {kind.__name__}",
            key,
        )
    return value


def _completion_prompt(body: dict[str, Any]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        words = tuple(prompt.split())
        ids = tuple(tokenize(prompt))
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        words = ()
        ids = tuple(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "The simulator supports one prompt per request.", "prompt")
    else:
        raise ApiError(
            400,
            "1 validation error: prompt: Input should be a string or a list of token ids",
            "prompt",
        )
    if not ids:
        raise ApiError(400, "The prompt cannot be empty.", "prompt")
    return ids, words


def _chat_prompt(body: dict[str, Any]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    messages = _chat_messages(body)
    text = render_chat(messages, add_generation_prompt=_generation_prompt(body))
    return tuple(tokenize(text)), tuple(message_text(messages[-1]).split())


def _generation_prompt(body: dict[str, Any]) -> bool:
    """Whether the chat's prompt ends with the generation prompt (vLLM's default)."""
    add = _opt(body, "add_generation_prompt", bool)
    if _opt(body, "continue_final_message", bool):
        if add:
            raise ApiError(
                400,
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            )
        return False
    return add is not False


def _chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(
            400, "1 validation error: messages: Field required (a non-empty list)", "messages"
        )
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(
                400, "1 validation error: messages: each message needs a 'role'", "messages"
            )
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ApiError(
                400,
                "1 validation error: messages: content must be a string or a list of parts",
                "messages",
            )
    return messages


def plan_output(params: GenerateParams, config: SimConfig) -> tuple[int, str, OutputText]:
    """Check lengths against the context and decide the answer: (tokens, reason, text);
    a matched stop string is the text's ``stop_reason``.

    As in vLLM 0.32: a prompt that fills the context, or ``max_tokens`` above
    ``max_model_len``, is a 400; otherwise ``max_tokens`` is clamped to the room left.
    """
    limit = config.max_model_len
    n_prompt = len(params.prompt_ids)
    if n_prompt >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {n_prompt} input tokens. Please reduce the length of the input prompt.",
        )
    if params.max_tokens is not None and params.max_tokens > limit:
        raise ApiError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. "
            f"This model's maximum context length is {limit} tokens.",
            "max_tokens",
        )
    room = limit - n_prompt
    budget = room if params.max_tokens is None else min(params.max_tokens, room)
    base = config.seed if params.seed is None else mix64(params.seed) ^ config.seed
    seed = prompt_seed(params.prompt_ids, base)
    source = params.echo_words if config.output == "echo" else ()
    count, reason, output = budget, "length", OutputText(seed, source)
    if not params.ignore_eos:
        natural = natural_length(seed, config.output_len_min, config.output_len_max)
        if natural <= budget:
            count, reason, output = natural, "stop", OutputText(seed, source, natural - 1)
    if params.stop:
        count, output = cut_at_stops(output, count, params.stop)
        if output.stop_reason is not None:
            reason = "stop"
    return count, reason, output
