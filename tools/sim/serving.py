"""One generate request on the engine, for every API that streams tokens from it
(completions, chat, the Messages API, scale-out's generate): admission, the request's life
in the engine, its stream, and a prefill instance's hand-off.

- ``admit``: before a request is submitted, the faults that stop it (an injected error,
  a server that never answers) and a full queue, as an ``ApiError`` each API answers in its
  own shape.
- ``running``: the request in the engine while the handler runs, counted in flight;
  however the handler ends (finished, client gone, fault) the request is released, which
  aborts it in the engine if it had not finished.
- ``stream``: the SSE loop all those APIs share, with the API's events (``StreamFormat``):
  nothing before the first token, the opening events with it, each token's events, then the
  closing ones; the mid-stream faults (``faults.py``) cut it with the API's failure events,
  a connection reset, or a hang until the client goes away.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from tools.sim.config import SimConfig
from tools.sim.driver import RequestHandle
from tools.sim.engine import TokenSource
from tools.sim.faults import StreamStop
from tools.sim.http import SSE_HEADERS, injected_error
from tools.sim.protocol import ApiError, GenerateParams, Outcome
from tools.sim.responses import StreamFormat
from tools.sim.state import SimState


async def hang() -> None:
    """Wait until the client goes away (which cancels the handler)."""
    await asyncio.get_running_loop().create_future()


async def admit(state: SimState) -> ApiError | None:
    """What stops a request before it reaches the engine: an injected error, a server that
    never answers (hangs here), or vLLM's full queue."""
    error = injected_error(state)
    if error is not None:
        return error
    if state.faults.hang_before_first_byte:
        await hang()
    limit = state.config.max_num_queued_reqs
    if limit is not None and len(state.engine.waiting) >= limit:
        return ApiError(503, "The engine's request queue is full.")
    return None


def request_ids(
    request: web.Request, config: SimConfig, default: str | None = None
) -> tuple[str, dict[str, str]]:
    """The request's base id (its ``X-Request-Id``, else ``default``, else a new one) and
    the headers that echo it back (with ``--enable-request-id-headers`` only, as vLLM)."""
    base_id = request.headers.get("X-Request-Id") or default or uuid.uuid4().hex
    return base_id, ({"X-Request-Id": base_id} if config.enable_request_id_headers else {})


def remote_decode(config: SimConfig, params: GenerateParams) -> bool:
    """A prefill instance's half of a disaggregated request (answered with the KV's
    ``kv_transfer_params``)."""
    return config.kv_producer and params.remote_decode


@contextmanager
def running(
    state: SimState,
    params: GenerateParams,
    planned: tuple[int, str, TokenSource],
    priority: int = 0,
) -> Iterator[RequestHandle]:
    """The request submitted to the engine as planned (``protocol.plan_output``) with its
    ``priority`` (``priority.py``), in flight until the block ends, then released (and
    aborted, if it had not finished)."""
    output_len, reason, output = planned
    config = state.config
    decode = remote_decode(config, params)
    handle = state.driver.submit(
        params.prompt_ids,
        output_len,
        reason,
        output,
        stream=params.stream,
        remote_decode=decode,
        remote_prefill=config.kv_consumer and not decode and params.remote_prefill,
        priority=priority,
    )
    state.in_flight += 1
    try:
        yield handle
    finally:
        state.in_flight -= 1
        state.driver.release(handle)


def outcome(handle: RequestHandle) -> Outcome:
    """How an ended request ended."""
    return Outcome(
        handle.num_tokens,
        handle.finish_reason or "abort",
        handle.cached_tokens,
        handle.created_tokens,
    )


async def whole(handle: RequestHandle) -> Outcome:
    """Wait for the end of a non-streaming request."""
    await handle.tokens()
    return outcome(handle)


async def stream(
    request: web.Request,
    state: SimState,
    handle: RequestHandle,
    fmt: StreamFormat,
    headers: dict[str, str],
) -> web.StreamResponse:
    """A streaming request's SSE answer, its events from ``fmt``, faults applied."""
    resp = web.StreamResponse(headers={**SSE_HEADERS, **headers})
    await resp.prepare(request)
    sent = 0
    stop: StreamStop | None = None  # the mid-stream fault that stopped the stream
    try:
        while stop is None:
            events = await handle.tokens()
            parts: list[bytes] = []
            for ev in events:
                stop = state.faults.stream_stop(sent)
                if stop is not None:
                    break
                if sent == 0:
                    # With the first token, as vLLM sends it: an engine that hangs (or fails)
                    # before its first token sends no opening either.
                    parts += fmt.opening()
                parts.append(fmt.token(ev))
                sent += 1
            finished = stop is None and handle.finished and sent == handle.num_tokens
            if finished:
                if sent == 0:  # aborted before its first token: vLLM still opens the stream
                    parts += fmt.opening()
                parts += fmt.closing(outcome(handle))
            elif stop == "error":
                parts += fmt.failure()
            if parts:
                await resp.write(b"".join(parts))
            if finished or stop == "error":
                await resp.write_eof()
                return resp
        if stop == "break":
            if request.transport is not None:
                request.transport.abort()  # a reset, as the client of a killed server sees
            return resp
        await hang()
    except ConnectionError:
        pass  # the client went away mid-write; the caller's finally aborts the request
    return resp


def handoff(
    request: web.Request,
    state: SimState,
    handle: RequestHandle,
    response_id: str,
    prompt_tokens: int,
) -> dict[str, object]:
    """A prefill instance's ``kv_transfer_params``, in the NIXL connector's fields.

    ``remote_host``/``remote_port`` are the address the request came in on (a real
    instance names its NIXL side channel); ``sim_request`` is the simulator's own handle.
    """
    state.prefills_handed_off += 1
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    host, port = (sock[0], sock[1]) if sock else ("127.0.0.1", 0)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(handle.block_ids),
        "remote_engine_id": state.engine_id,
        "remote_request_id": response_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "remote_num_tokens": prompt_tokens,
        "sim_request": f"{state.engine_id}/{handle.request_id}",
    }
