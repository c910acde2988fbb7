"""The model-addressed endpoints of vLLM's API that the gateway routes, and what each one is.

vLLM 0.32 registers its routes by what the engine runs (``vllm/entrypoints/launchers/
api_server/routers.py``): a server started with ``--runner generate`` (the default) answers the
generation endpoints, one started with ``--runner pooling`` the pooling ones (embeddings,
pooling, classification, scoring and reranking), a generation server of a speech-to-text model
the audio ones too (``multipart/form-data`` bodies), and every server tokenizes. One model name may
therefore be served by both kinds of server; the gateway learns which backend lacks which
endpoint from FastAPI's own answer to an unregistered route (``{"detail": "Not Found"}``) and
stops sending it there (``backends.pool``).

What each API does differently is its ``Api`` (``gateway.request.apis``) and whose shapes its
clients parse its ``Dialect`` (``gateway.request.dialects``): adding an API is a module there and
a row here. Pure: a table; ``gateway.request.proxy`` does the I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final, Literal

from gateway.request.api import PLAIN, Api
from gateway.request.apis.chat import CHAT_API, COMPLETIONS_API
from gateway.request.apis.generate import GENERATE_API
from gateway.request.apis.messages import MESSAGES_API, MESSAGES_SIDE_API
from gateway.request.apis.responses import RESPONSES_API
from gateway.request.dialects import ANTHROPIC, MESSAGES_PATH, OPENAI, Dialect

Stream = Literal["none", "data", "events"]  # no SSE; chat-style ``data:`` lines; named events
# Where vLLM reads the gateway's priority for the engines (``gateway.request.priority``): its
# ``X-Vllm-Priority`` header, or only the body's ``priority`` field.
PriorityIn = Literal["header", "body"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str  # the ``endpoint`` metric label, bounded by this table
    paths: tuple[str, ...]  # the same endpoint under each path vLLM serves it at
    stream: Stream = "none"
    generates: bool = False  # reserves a completion budget (``max_tokens`` or a default)
    form: bool = False  # a multipart/form-data body (``gateway.request.form``), not JSON
    dialect: Dialect = OPENAI
    api: Api = PLAIN
    streams_tokens: bool = False  # ``"stream": true`` streams tokens (the first awaited apart)
    priority: PriorityIn | None = None  # None: vLLM takes no priority there


# generation servers (--runner generate):
CHAT: Final = Endpoint(
    "chat",
    ("/v1/chat/completions",),
    "data",
    api=CHAT_API,
    priority="header",
    generates=True,
    streams_tokens=True,
)
COMPLETIONS: Final = Endpoint(
    "completions",
    ("/v1/completions",),
    "data",
    api=COMPLETIONS_API,
    priority="header",
    generates=True,
    streams_tokens=True,
)
RESPONSES: Final = Endpoint(
    "responses",
    ("/v1/responses",),
    "events",
    api=RESPONSES_API,
    priority="header",
    generates=True,
    streams_tokens=True,
)
# vLLM's token-in, token-out route (``--enable-scale-out``; 403 without it).
GENERATE: Final = Endpoint(
    "generate",
    ("/inference/v1/generate",),
    "data",
    api=GENERATE_API,
    priority="body",
    generates=True,
    streams_tokens=True,
)
# Anthropic's Messages API: vLLM renders it as a chat; named events, usage in message_delta.
MESSAGES: Final = Endpoint(
    "messages",
    (MESSAGES_PATH,),
    "events",
    dialect=ANTHROPIC,
    api=MESSAGES_API,
    priority="header",
    generates=True,
    streams_tokens=True,
)
COUNT_TOKENS: Final = Endpoint(
    "count_tokens", (MESSAGES_PATH + "/count_tokens",), dialect=ANTHROPIC, api=MESSAGES_SIDE_API
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
MESSAGES_RENDER: Final = Endpoint(
    "render", (MESSAGES_PATH + "/render",), dialect=ANTHROPIC, api=MESSAGES_SIDE_API
)
# generation servers of a speech-to-text model (Whisper's kind): multipart bodies
TRANSCRIPTIONS: Final = Endpoint(
    "transcriptions", ("/v1/audio/transcriptions",), "data", generates=True, form=True
)
TRANSLATIONS: Final = Endpoint(
    "translations", ("/v1/audio/translations",), "data", generates=True, form=True
)
# pooling servers (--runner pooling):
EMBEDDINGS: Final = Endpoint("embeddings", ("/v1/embeddings",), priority="body")
POOLING: Final = Endpoint("pooling", ("/pooling",), priority="body")
CLASSIFY: Final = Endpoint("classify", ("/classify",), priority="body")
SCORE: Final = Endpoint("score", ("/score", "/v1/score"), priority="body")
RERANK: Final = Endpoint("rerank", ("/rerank", "/v1/rerank", "/v2/rerank"), priority="body")
# every server:
TOKENIZE: Final = Endpoint("tokenize", ("/tokenize",))
DETOKENIZE: Final = Endpoint("detokenize", ("/detokenize",))

# The table: every endpoint the data plane routes (``gateway.request.routes``).
ENDPOINTS: Final = (
    CHAT,
    COMPLETIONS,
    RESPONSES,
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
    TRANSCRIPTIONS,
    TRANSLATIONS,
    EMBEDDINGS,
    POOLING,
    CLASSIFY,
    SCORE,
    RERANK,
    TOKENIZE,
    DETOKENIZE,
)


# What a server started without ``--enable-scale-out`` answers on those routes (with a 403).
_SCALE_OUT_DISABLED: Final = b"Scale-out endpoints are disabled"


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
