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


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str  # the ``endpoint`` metric label, bounded by this table
    paths: tuple[str, ...]  # the same endpoint under each path vLLM serves it at
    stream: Stream = "none"
    generates: bool = False  # reserves a completion budget (``max_tokens`` or a default)
    form: bool = False  # a multipart/form-data body (``gateway.request.form``), not JSON


# generation servers (--runner generate):
CHAT: Final = Endpoint("chat", ("/v1/chat/completions",), "data", generates=True)
COMPLETIONS: Final = Endpoint("completions", ("/v1/completions",), "data", generates=True)
RESPONSES: Final = Endpoint("responses", ("/v1/responses",), "events", generates=True)
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
    EMBEDDINGS,
    POOLING,
    CLASSIFY,
    SCORE,
    RERANK,
    TOKENIZE,
    DETOKENIZE,
)
FORM_ENDPOINTS: Final = (TRANSCRIPTIONS, TRANSLATIONS)


def is_route_missing(status: int, body: bytes) -> bool:
    """Whether a backend's answer says it has no such route (FastAPI's default 404), as
    opposed to vLLM's own 404 (an unknown model, a response it does not hold)."""
    if status != 404 or len(body) > 64:
        return False
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return bool(doc == {"detail": "Not Found"})
