"""LoRA adapters across the fleet: loading and unloading them through the admin API.

A backend's adapters are models in its ``/v1/models`` (their ``parent`` the base model), so
the pool routes a request for an adapter only to the backends that list it, as for any model:
nothing here is on the request path. ``POST /admin/lora/load`` loads an adapter on backends
serving its base model (vLLM's ``/v1/load_lora_adapter``; the backends need ``--enable-lora``
and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): on the ones named, or on all of them, or, with
``replicas: k``, on k of them, packed (``place``: those that hold it already first, then the
least loaded), so an adapter used by few takes few backends' adapter slots.
``POST /admin/lora/unload`` takes it off (every backend listing it, or the ones named).

A load or unload runs once, from the replica that was asked (the backends hold adapters, not
the replicas); what it did is then recorded in the fleet's change log (``record_done``), so
every replica routes to the adapter at once rather than at its next poll of the backends'
models, and the audit trail and the fleet's snapshot say which adapters are loaded where.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import structlog
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from backends.errors import InvalidRequest, NotFound, UpstreamError
from backends.state import BackendState
from gateway.admin.actions import ADAPTERS_PATH
from gateway.admin.context import admin_of
from gateway.admin.fleet import record_done

log = structlog.get_logger("gateway.admin.lora")


class LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    model: str = Field(min_length=1, description="the base model it adapts")
    backends: list[str] | None = Field(None, min_length=1)
    replicas: int | None = Field(None, ge=1)


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    backends: list[str] | None = Field(None, min_length=1)


def place(holding: Sequence[str], others: Sequence[tuple[str, int]], replicas: int) -> list[str]:
    """``replicas`` backends for an adapter: those ``holding`` it first, then ``others``
    (id, in flight) from the least loaded. Pure."""
    chosen = list(holding[:replicas])
    for backend, _ in sorted(others, key=lambda o: (o[1], o[0])):
        if len(chosen) >= replicas:
            break
        chosen.append(backend)
    return chosen


async def _body(request: web.Request, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(await request.json())
    except ValueError as exc:  # pydantic's ValidationError is one
        detail = (
            "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
            if isinstance(exc, ValidationError)
            else "the body must be JSON"
        )
        raise InvalidRequest(f"Invalid adapter request: {detail}.") from exc


def _named(pool_backends: dict[str, BackendState], names: list[str], what: str) -> list[str]:
    unknown = [n for n in names if n not in pool_backends]
    if unknown:
        raise InvalidRequest(f"Not {what}: {', '.join(unknown)}.", param="backends")
    return names


async def _call(
    request: web.Request, b: BackendState, path: str, doc: dict[str, str]
) -> tuple[bool, str]:
    """One backend's answer to a load or unload: (succeeded, what it said)."""
    transport = admin_of(request).svc.upstream
    headers = {"Content-Type": "application/json"}
    try:
        upstream = await transport.open(b.spec, path, json.dumps(doc).encode(), headers)
        try:
            text = (await transport.read_body(upstream)).decode(errors="replace")
        finally:
            transport.finish(upstream, complete=True)
    except UpstreamError as exc:
        return False, exc.message
    if upstream.status == 200:
        return True, text
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text[:300]
    return False, f"{upstream.status}: {message}"


async def load_adapter(request: web.Request) -> web.Response:
    pool = admin_of(request).svc.pool
    body: LoadAdapter = await _body(request, LoadAdapter)
    serving = {b.id: b for b in pool.all() if body.model in b.models and not b.removed}
    if not serving:
        raise NotFound(f"No backend serves the base model `{body.model}`.")
    elsewhere = [b.id for b in pool.all() if body.lora_name in b.models and b.id not in serving]
    if body.lora_name == body.model or elsewhere:  # one name, two models: refused
        raise InvalidRequest(
            f"`{body.lora_name}` is already the name of another model the fleet serves.",
            param="lora_name",
        )
    if body.backends is not None:
        targets = _named(serving, body.backends, f"backends serving `{body.model}`")
    elif body.replicas is not None:
        holding = sorted(i for i, b in serving.items() if body.lora_name in b.models)
        others = [(i, b.in_flight) for i, b in serving.items() if i not in holding]
        targets = place(holding, others, body.replicas)
    else:
        targets = sorted(serving)
    already = [i for i in targets if body.lora_name in serving[i].models]
    todo = [i for i in targets if i not in already]
    doc = {"lora_name": body.lora_name, "lora_path": body.lora_path}
    answers = await asyncio.gather(
        *(_call(request, serving[i], "/v1/load_lora_adapter", doc) for i in todo)
    )
    loaded, failed = [], {}
    for backend, (ok, said) in zip(todo, answers, strict=True):
        if ok:
            loaded.append(backend)
        else:
            failed[backend] = said
    log.info(
        "lora_loaded", lora=body.lora_name, model=body.model, loaded=loaded, failed=list(failed)
    )
    headers: dict[str, str] = {}
    if loaded:  # every replica routes to it at once (the fleet's log)
        record = {
            "op": "load",
            "lora_name": body.lora_name,
            "lora_path": body.lora_path,
            "model": body.model,
            "backends": loaded,
        }
        headers = await record_done(request, ADAPTERS_PATH, record)
    result = {"lora_name": body.lora_name, "loaded": loaded, "already": already, "failed": failed}
    status = 502 if failed and not (loaded or already) else 200
    return web.json_response(result, status=status, headers=headers)


async def unload_adapter(request: web.Request) -> web.Response:
    pool = admin_of(request).svc.pool
    body: UnloadAdapter = await _body(request, UnloadAdapter)
    holding = {b.id: b for b in pool.all() if body.lora_name in b.models}
    if not holding:
        raise NotFound(f"No backend serves the adapter `{body.lora_name}`.")
    names = sorted(holding) if body.backends is None else body.backends
    targets = _named(holding, names, f"backends serving `{body.lora_name}`")
    doc = {"lora_name": body.lora_name}
    answers = await asyncio.gather(
        *(_call(request, holding[i], "/v1/unload_lora_adapter", doc) for i in targets)
    )
    unloaded, failed = [], {}
    for backend, (ok, said) in zip(targets, answers, strict=True):
        if ok:
            unloaded.append(backend)
        else:
            failed[backend] = said
    log.info("lora_unloaded", lora=body.lora_name, unloaded=unloaded, failed=list(failed))
    headers: dict[str, str] = {}
    if unloaded:
        record = {"op": "unload", "lora_name": body.lora_name, "backends": unloaded}
        headers = await record_done(request, ADAPTERS_PATH, record)
    result = {"lora_name": body.lora_name, "unloaded": unloaded, "failed": failed}
    status = 502 if failed and not unloaded else 200
    return web.json_response(result, status=status, headers=headers)
