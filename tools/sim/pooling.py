"""vLLM's pooling endpoints as a ``--runner pooling`` server of a decoder model answers them.

vLLM 0.32 turns a causal LM served with ``--runner pooling`` into an embedding model (last-
token pooling, normalised): it then answers ``/v1/embeddings``, ``/pooling``, ``/score`` (and
``/v1/score``) and ``/rerank`` (``/v1/rerank``, ``/v2/rerank``), scoring by the cosine of the
two embeddings, and not ``/classify`` (no classification head). The shapes are its protocol
classes' (``vllm/entrypoints/pooling/*/protocol.py``); usage counts prompt tokens only.

The vectors are the simulator's own: a deterministic function of the text's token ids, so
equal texts embed equally and a test can check what came back. Pure: bodies in, documents out.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from typing import Any, Final

from gateway.tokenizer.words import tokenize
from tools.sim.protocol import ApiError
from tools.sim.tokens import mix64

EMBEDDING_DIM: Final = 32  # the tiny e2e model's hidden size is 128; any size will do here


def _texts(value: Any, field: str) -> list[str | list[int]]:
    """A text field as vLLM takes it: a string, token ids, or a list of either."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [value]
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(isinstance(v, list) and all(isinstance(i, int) for i in v) for v in value):
            return list(value)
    raise ApiError(400, f"1 validation error: {field}: Input should be a string or a list", field)


def _ids(text: str | list[int]) -> list[int]:
    return tokenize(text) if isinstance(text, str) else list(text)


def embed(ids: Sequence[int]) -> list[float]:
    """A unit vector determined by the token ids (the same ids, the same vector)."""
    vec = [0.0] * EMBEDDING_DIM
    for pos, tok in enumerate(ids):
        h = mix64(tok * 1_000_003 + pos % 7)
        for d in range(EMBEDDING_DIM):
            vec[d] += ((h >> (d * 2 % 64)) & 0xFF) / 127.5 - 1.0
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [round(v / norm, 6) for v in vec]


def _usage(prompt_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def _head(prefix: str, model: str) -> dict[str, Any]:
    return {
        "id": f"{prefix}-{uuid.uuid4().hex[:16]}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
    }


def embeddings(body: dict[str, Any], model: str, *, pooling: bool = False) -> dict[str, Any]:
    """``/v1/embeddings`` (or, with ``pooling``, ``/pooling``): one vector per input."""
    if "input" not in body:
        raise ApiError(400, "1 validation error: input: Field required", "input")
    items = [_ids(t) for t in _texts(body["input"], "input")]
    kind = "pooling" if pooling else "embedding"
    data = [
        {"index": i, "object": kind, ("data" if pooling else "embedding"): embed(ids)}
        for i, ids in enumerate(items)
    ]
    return {
        **_head("pooling" if pooling else "embd", model),
        "data": data,
        "usage": _usage(sum(len(ids) for ids in items)),
    }


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    return round(sum(x * y for x, y in zip(a, b, strict=True)), 6)


def _pair(body: dict[str, Any]) -> tuple[list[str | list[int]], list[str | list[int]]]:
    for left, right in (
        ("queries", "documents"),
        ("queries", "items"),
        ("text_1", "text_2"),
        ("data_1", "data_2"),
    ):
        if left in body and right in body:
            return _texts(body[left], left), _texts(body[right], right)
    raise ApiError(400, "1 validation error: queries and documents: Field required", "queries")


def score(body: dict[str, Any], model: str) -> dict[str, Any]:
    """``/score``: each document against the query (one query, or one per document)."""
    queries, documents = _pair(body)
    if len(queries) not in (1, len(documents)):
        raise ApiError(400, "There must be one query, or as many as there are documents.")
    q_ids = [_ids(q) for q in queries]
    d_ids = [_ids(d) for d in documents]
    data = []
    for i, ids in enumerate(d_ids):
        q = q_ids[0] if len(q_ids) == 1 else q_ids[i]
        data.append({"index": i, "object": "score", "score": _cosine(embed(q), embed(ids))})
    used = sum(len(q_ids[0] if len(q_ids) == 1 else q_ids[i]) + len(d) for i, d in enumerate(d_ids))
    return {**_head("score", model), "data": data, "usage": _usage(used)}


def rerank(body: dict[str, Any], model: str) -> dict[str, Any]:
    """``/rerank``: the documents by relevance to the query, best first, ``top_n`` of them."""
    query = body.get("query")
    if not isinstance(query, str):
        raise ApiError(400, "1 validation error: query: Field required", "query")
    documents = _texts(body.get("documents"), "documents")
    top_n = body.get("top_n") or len(documents)
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise ApiError(400, "1 validation error: top_n: Input should be a valid integer", "top_n")
    q = _ids(query)
    ranked = sorted(
        (
            {
                "index": i,
                "document": {"text": d if isinstance(d, str) else None, "multi_modal": None},
                "relevance_score": _cosine(embed(q), embed(_ids(d))),
            }
            for i, d in enumerate(documents)
        ),
        key=lambda r: -float(r["relevance_score"]),  # type: ignore[arg-type]
    )
    used = sum(len(q) + len(_ids(d)) for d in documents)
    return {
        "id": f"score-{uuid.uuid4().hex[:16]}",
        "model": model,
        "usage": {"prompt_tokens": used, "total_tokens": used},
        "results": ranked[:top_n],
    }
