"""The model-addressed endpoints of vLLM's API that the gateway routes, and what each one is.

vLLM 0.32 registers its routes by what the engine runs (``vllm/entrypoints/launchers/
api_server/routers.py``): a server started with ``--runner generate`` (the default) answers the
generation endpoints, one started with ``--runner pooling`` the pooling ones (embeddings,
pooling, classification, scoring and reranking), a generation server of a speech-to-text model
the audio ones too (``multipart/form-data`` bodies), and every server tokenizes. One model name may
therefore be served by both kinds of server; the gateway learns which backend lacks which
endpoint from FastAPI's own answer to an unregistered route (``{"detail": "Not Found"}``) and
stops sending it there (``backends.pool``).

Pure: a table and the arithmetic of what a body asks for; ``gateway.request.proxy`` does the I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final, Literal

Stream = Literal["none", "data", "events"]  # no SSE; chat-style ``data:`` lines; named events
# Whose API the endpoint speaks, so whose error shape its clients parse: OpenAI's
# ``{"error": {...}}`` or Anthropic's ``{"type": "error", "error": {...}}`` (``/v1/messages``).
Dialect = Literal["openai", "anthropic"]
MESSAGES_PATH: Final = "/v1/messages"


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str  # the ``endpoint`` metric label, bounded by this table
    paths: tuple[str, ...]  # the same endpoint under each path vLLM serves it at
    stream: Stream = "none"
    generates: bool = False  # reserves a completion budget (``max_tokens`` or a default)
    form: bool = False  # a multipart/form-data body (``gateway.request.form``), not JSON
    dialect: Dialect = "openai"


# generation servers (--runner generate):
CHAT: Final = Endpoint("chat", ("/v1/chat/completions",), "data", generates=True)
COMPLETIONS: Final = Endpoint("completions", ("/v1/completions",), "data", generates=True)
RESPONSES: Final = Endpoint("responses", ("/v1/responses",), "events", generates=True)
# vLLM's token-in, token-out route (``--enable-scale-out``; 403 without it).
GENERATE: Final = Endpoint("generate", ("/inference/v1/generate",), "data", generates=True)
# Anthropic's Messages API: vLLM renders it as a chat; named events, usage in message_delta.
MESSAGES: Final = Endpoint(
    "messages", (MESSAGES_PATH,), "events", generates=True, dialect="anthropic"
)
COUNT_TOKENS: Final = Endpoint(
    "count_tokens", (MESSAGES_PATH + "/count_tokens",), dialect="anthropic"
)
# Several conversations in one body, answered together (not streamed).
CHAT_BATCH: Final = Endpoint("chat_batch", ("/v1/chat/completions/batch",), generates=True)
GENERATIVE_SCORING: Final = Endpoint("generative_scoring", ("/generative_scoring",))
STRUCTURED_DECISIONS: Final = Endpoint("structured_decisions", ("/v1/systemone",), generates=True)
# Cohere's API (vLLM answers in Cohere's shapes; the gateway's own errors stay OpenAI's).
COHERE_CHAT: Final = Endpoint("cohere_chat", ("/cohere/v2/chat",), generates=True)
EMBED: Final = Endpoint("embed", ("/v2/embed",))
# SageMaker's one route: the server picks chat, completions, embeddings... by the body's shape.
INVOCATIONS: Final = Endpoint("invocations", ("/invocations",), generates=True)
# vLLM's scale-out routes (``--enable-scale-out``; 403 without it): the prompt's tokens as the
# engine would see them. One name: a server has all of them or none.
RENDER: Final = Endpoint(
    "render",
    (
        "/v1/chat/completions/render",
        "/v1/completions/render",
        "/v1/responses/render",
        "/v1/chat/completions/derender",
        "/v1/completions/derender",
    ),
)
MESSAGES_RENDER: Final = Endpoint("render", (MESSAGES_PATH + "/render",), dialect="anthropic")
# generation servers of a speech-to-text model (Whisper's kind): multipart bodies
TRANSCRIPTIONS: Final = Endpoint(
    "transcriptions", ("/v1/audio/transcriptions",), "data", generates=True, form=True
)
TRANSLATIONS: Final = Endpoint(
    "translations", ("/v1/audio/translations",), "data", generates=True, form=True
)
# pooling servers (--runner pooling):
EMBEDDINGS: Final = Endpoint("embeddings", ("/v1/embeddings",))
POOLING: Final = Endpoint("pooling", ("/pooling",))
CLASSIFY: Final = Endpoint("classify", ("/classify",))
SCORE: Final = Endpoint("score", ("/score", "/v1/score"))
RERANK: Final = Endpoint("rerank", ("/rerank", "/v1/rerank", "/v2/rerank"))
# every server:
TOKENIZE: Final = Endpoint("tokenize", ("/tokenize",))
DETOKENIZE: Final = Endpoint("detokenize", ("/detokenize",))

JSON_ENDPOINTS: Final = (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    COUNT_TOKENS,
    GENERATE,
    CHAT_BATCH,
    GENERATIVE_SCORING,
    STRUCTURED_DECISIONS,
    COHERE_CHAT,
    EMBED,
    INVOCATIONS,
    RENDER,
    MESSAGES_RENDER,
    EMBEDDINGS,
    POOLING,
    CLASSIFY,
    SCORE,
    RERANK,
    TOKENIZE,
    DETOKENIZE,
)
FORM_ENDPOINTS: Final = (TRANSCRIPTIONS, TRANSLATIONS)


# What a server started without ``--enable-scale-out`` answers on those routes (with a 403).
_SCALE_OUT_DISABLED: Final = b"Scale-out endpoints are disabled"


def dialect_of(path: str) -> Dialect:
    """Whose error shape a request to ``path`` is answered in (any path, routed or not)."""
    if path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/"):
        return "anthropic"
    return "openai"


def is_route_missing(status: int, body: bytes) -> bool:
    """Whether a backend's answer says it has no such route (FastAPI's default 404, or the
    403 of a scale-out route on a server without the flag), as opposed to vLLM's own 404 (an
    unknown model, a response it does not hold)."""
    if status == 403:
        return _SCALE_OUT_DISABLED in body[:512]
    if status != 404 or len(body) > 64:
        return False
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return bool(doc == {"detail": "Not Found"})
