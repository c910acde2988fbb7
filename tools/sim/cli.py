"""``llm-gateway sim``: options (vLLM's names where vLLM has the option) and the runner."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Mapping
from typing import Final

from gateway.helpfmt import DefaultsHelp
from tools.sim.config import KV_ROLES, SCHEDULING_POLICIES, KvRole, SimConfig
from tools.sim.faults import Faults, FaultsError
from tools.sim.kvevents import KvEventsConfig
from tools.sim.runner import SimServer

DESCRIPTION: Final = (
    "Run a simulated vLLM 0.32 server: the same HTTP API, SSE format, errors and "
    "/metrics, over a simulated engine (continuous batching, chunked prefill, paged KV "
    "cache with prefix caching and preemption) stepped on simulated time, with faults "
    "on demand. Engine options keep vLLM's names; --sim-* options set the cost model."
)

_D = SimConfig()
DEV_MODE_ENV: Final = "VLLM_SERVER_DEV_MODE"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the simulator's options to ``parser``."""
    parser.formatter_class = DefaultsHelp
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on")
    net.add_argument("--port", type=int, default=8000, help="port to listen on (0: any)")
    net.add_argument("--admin-token", default=None, help="enable /sim/* with this Bearer token")
    net.add_argument("--enable-server-load-tracking", action="store_true", help="/load counts")
    net.add_argument(
        "--enable-request-id-headers", action="store_true", help="echo X-Request-Id back"
    )
    net.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage reports prefix-cache hits (prompt_tokens_details, cache_read_input_tokens)",
    )
    net.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="serve /v1/{chat/completions,completions,messages}/render, /inference/v1/generate "
        "and /inference/v1/abort_requests (else 403, as vLLM)",
    )

    eng = parser.add_argument_group("engine (vLLM engine arguments)")
    eng.add_argument(
        "--model", default=_D.model, help="model name (served as is, or as --served-model-name)"
    )
    eng.add_argument("--served-model-name", default=None, help="name clients use")
    eng.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (and /v1/load_lora_adapter, /v1/unload_lora_adapter)",
    )
    eng.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="adapters served from the start (needs --enable-lora)",
    )
    eng.add_argument(
        "--audio",
        action="store_true",
        help="a speech-to-text model: /v1/audio/transcriptions and /v1/audio/translations",
    )
    eng.add_argument(
        "--runner",
        choices=("generate", "pooling"),
        default=_D.runner,
        help="generate (chat, completions) or pooling (embeddings, score, rerank), as vLLM's",
    )
    eng.add_argument(
        "--max-model-len", type=int, default=_D.max_model_len, help="longest prompt + output"
    )
    _add_scheduler_arguments(eng)
    eng.add_argument("--block-size", type=int, default=_D.block_size, help="tokens per KV block")
    eng.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=_D.num_gpu_blocks_override,
        help="number of KV cache blocks",
    )
    eng.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_D.enable_prefix_caching,
        help="reuse cached blocks of a prompt's prefix",
    )
    eng.add_argument("--seed", type=int, default=_D.seed, help="seed of the generated text")
    eng.add_argument(
        "--kv-events-config",
        default=None,
        help='vLLM\'s JSON form, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'; tcp://*:0 binds '
        '127.0.0.1 on a free port. Simulator only: "wire": "positional" (events as arrays, '
        'vLLM < 0.11), "hashes": "bytes" (32-byte hashes)',
    )

    kv = parser.add_argument_group("disaggregated prefill (vLLM's KV connector)")
    kv.add_argument(
        "--kv-role",
        choices=KV_ROLES,
        default=None,
        help="kv_producer: prefill instance; kv_consumer: decode instance; kv_both: either "
        "(default: no KV connector, kv_transfer_params are ignored)",
    )
    kv.add_argument(
        "--kv-transfer-config",
        default=None,
        help='vLLM\'s JSON form, e.g. \'{"kv_connector":"NixlConnector","kv_role":'
        '"kv_both"}\'; only kv_role is read (--kv-role wins)',
    )
    kv.add_argument(
        "--sim-kv-transfer-us-per-token",
        type=float,
        default=_D.kv_transfer_us_per_token,
        help="simulated KV transfer time per prompt token a decode instance receives",
    )

    sim = parser.add_argument_group("simulation (step cost model and output)")
    sim.add_argument(
        "--sim-step-base-ms", type=float, default=_D.step_base_ms, help="fixed cost of a step"
    )
    sim.add_argument(
        "--sim-prefill-us-per-token",
        type=float,
        default=_D.prefill_us_per_token,
        help="step cost per prompt token computed",
    )
    sim.add_argument(
        "--sim-decode-us-per-seq",
        type=float,
        default=_D.decode_us_per_seq,
        help="step cost per decoding sequence",
    )
    sim.add_argument(
        "--sim-attention-ns-per-token",
        type=float,
        default=_D.attention_ns_per_token,
        help="per context token read by each decoding sequence",
    )
    sim.add_argument(
        "--sim-output",
        choices=["random", "echo"],
        default=_D.output,
        help="random words, or the prompt repeated",
    )
    sim.add_argument(
        "--sim-output-len-min",
        type=int,
        default=_D.output_len_min,
        help="shortest natural answer (EOS), when ignore_eos is false",
    )
    sim.add_argument(
        "--sim-output-len-max", type=int, default=_D.output_len_max, help="longest natural answer"
    )
    sim.add_argument(
        "--startup-delay", type=float, default=0.0, help="seconds bound but not answering"
    )

    _add_sleep_arguments(parser)

    flt = parser.add_argument_group("faults (also changeable at run time via /sim/faults)")
    flt.add_argument("--slowdown", type=float, default=1.0, help="multiplies step durations")
    flt.add_argument("--error-rate", type=float, default=0.0, help="fraction answered with error")
    flt.add_argument(
        "--error-status", type=int, default=500, help="HTTP status of --error-rate's answers"
    )
    flt.add_argument(
        "--hang-before-first-byte", action="store_true", help="accept requests, never answer"
    )
    flt.add_argument("--hang-after-tokens", type=int, default=None, help="streams stall after N")
    flt.add_argument(
        "--break-after-tokens",
        type=int,
        default=None,
        help="streams' connections are reset after N tokens (a killed server)",
    )
    flt.add_argument(
        "--error-after-tokens",
        type=int,
        default=None,
        help="streams end after N tokens with vLLM's error event, then [DONE] (a failed engine)",
    )
    flt.add_argument("--refuse-connections", action="store_true", help="close the listening socket")
    flt.add_argument("--unhealthy", action="store_true", help="/health answers 503")


def _add_scheduler_arguments(eng: argparse._ArgumentGroup) -> None:
    eng.add_argument(
        "--max-num-seqs", type=int, default=_D.max_num_seqs, help="sequences run at once"
    )
    eng.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_D.max_num_batched_tokens,
        help="tokens scheduled per step (prefill chunks and decodes)",
    )
    eng.add_argument(
        "--max-num-queued-reqs", type=int, default=None, help="503 beyond (default unbounded)"
    )
    eng.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=_D.scheduling_policy,
        help="fcfs: first come first served; priority: by each request's priority (lower "
        "first, then arrival), preempting the least important running request when the KV "
        "cache runs out",
    )


def _add_sleep_arguments(parser: argparse.ArgumentParser) -> None:
    slp = parser.add_argument_group("sleep mode (vLLM's dev routes)")
    slp.add_argument(
        "--dev-mode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve vLLM's dev routes /sleep, /wake_up and /is_sleeping (default: on when "
        f"{DEV_MODE_ENV}=1, as vLLM)",
    )
    slp.add_argument(
        "--wake-time",
        type=float,
        default=_D.wake_time,
        help="seconds /wake_up takes to bring the weights back after sleep level 1",
    )
    slp.add_argument(
        "--wake-time-level2",
        type=float,
        default=_D.wake_time_level2,
        help="seconds /wake_up takes to load the weights again after sleep level 2",
    )
    slp.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=_D.gpu_memory_gib,
        help="GPU memory of the model's weights (sim:gpu_memory_used_bytes)",
    )
    slp.add_argument(
        "--kv-cache-kib-per-token",
        type=float,
        default=_D.kv_cache_kib_per_token,
        help="GPU memory of the KV cache per token it holds (blocks x block size)",
    )


def _lora_module(item: str) -> tuple[str, str]:
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"--lora-modules takes NAME=PATH, got {item!r}")
    return name, path


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> SimConfig:
    """The options as a ``SimConfig``; ``--dev-mode``'s default is read from ``environ``."""
    return SimConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        runner=args.runner,
        enable_lora=args.enable_lora,
        audio=args.audio,
        lora_modules=tuple(_lora_module(m) for m in args.lora_modules),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_queued_reqs=args.max_num_queued_reqs,
        scheduling_policy=args.scheduling_policy,
        block_size=args.block_size,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_server_load_tracking=args.enable_server_load_tracking,
        enable_request_id_headers=args.enable_request_id_headers,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_scale_out=args.enable_scale_out,
        step_base_ms=args.sim_step_base_ms,
        prefill_us_per_token=args.sim_prefill_us_per_token,
        decode_us_per_seq=args.sim_decode_us_per_seq,
        attention_ns_per_token=args.sim_attention_ns_per_token,
        output=args.sim_output,
        output_len_min=args.sim_output_len_min,
        output_len_max=args.sim_output_len_max,
        seed=args.seed,
        admin_token=args.admin_token,
        startup_delay_s=args.startup_delay,
        kv_role=_kv_role(args),
        kv_transfer_us_per_token=args.sim_kv_transfer_us_per_token,
        kv_events=_kv_events(args),
        dev_mode=_dev_mode(args, environ),
        wake_time=args.wake_time,
        wake_time_level2=args.wake_time_level2,
        gpu_memory_gib=args.gpu_memory_gib,
        kv_cache_kib_per_token=args.kv_cache_kib_per_token,
    )


def _dev_mode(args: argparse.Namespace, environ: Mapping[str, str]) -> bool:
    """``--[no-]dev-mode``, else vLLM's environment variable, read as vLLM reads it (an
    integer, 0 when unset)."""
    if args.dev_mode is not None:
        return bool(args.dev_mode)
    raw = environ.get(DEV_MODE_ENV, "0")
    try:
        return bool(int(raw))
    except ValueError:
        raise ValueError(f"{DEV_MODE_ENV} must be an integer (0 or 1), got {raw!r}") from None


def _kv_events(args: argparse.Namespace) -> KvEventsConfig | None:
    text: str | None = args.kv_events_config
    return None if text is None else KvEventsConfig.from_json(text)


def _kv_role(args: argparse.Namespace) -> KvRole | None:
    role: KvRole | None = args.kv_role
    if role is None and args.kv_transfer_config:
        try:
            doc = json.loads(args.kv_transfer_config)
        except ValueError as exc:
            raise ValueError(f"--kv-transfer-config is not JSON: {exc}") from exc
        value = doc.get("kv_role") if isinstance(doc, dict) else None
        if value not in KV_ROLES:
            raise ValueError(f"--kv-transfer-config needs a kv_role of {', '.join(KV_ROLES)}")
        role = value
    return role


def faults_from_args(args: argparse.Namespace) -> Faults:
    return Faults(
        slowdown=args.slowdown,
        error_rate=args.error_rate,
        error_status=args.error_status,
        hang_before_first_byte=args.hang_before_first_byte,
        hang_after_tokens=args.hang_after_tokens,
        break_after_tokens=args.break_after_tokens,
        error_after_tokens=args.error_after_tokens,
        refuse_connections=args.refuse_connections,
        unhealthy=args.unhealthy,
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; 2 on bad options."""
    try:
        config = config_from_args(args)
        faults = faults_from_args(args)
    except (ValueError, FaultsError) as exc:
        print(f"llm-gateway sim: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        asyncio.run(_serve(config, faults, args.host, args.port))
    else:
        uvloop.run(_serve(config, faults, args.host, args.port))
    return 0


async def _serve(config: SimConfig, faults: Faults, host: str, port: int) -> None:
    server = SimServer(config, host=host, port=port, faults=faults)
    await server.start()
    print(
        f"llm-gateway sim: serving {config.model_name!r} on {server.url}",
        file=sys.stderr,
        flush=True,
    )
    if server.kv_events.endpoint is not None:
        replay = server.kv_events.replay_endpoint
        print(
            f"llm-gateway sim: KV events on {server.kv_events.endpoint}"
            + (f", replay on {replay}" if replay else ""),
            file=sys.stderr,
            flush=True,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()
