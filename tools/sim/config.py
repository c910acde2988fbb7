"""Simulator configuration: one frozen value, built once from the CLI or by a test.

Options that mirror a vLLM engine argument keep vLLM's name (``max_num_seqs``,
``block_size``, ...). The cost coefficients are the simulator's own: a step takes

    step_base_ms + prefill_us_per_token * prefill tokens
                 + decode_us_per_seq * decoding sequences
                 + attention_ns_per_token * context tokens read by decoding sequences

of simulated time, multiplied by the ``slowdown`` fault. The defaults give figures of
the order of a 7B model on one data-centre GPU: about 22 ms between tokens at low batch,
a few tens of milliseconds to the first token of a short prompt, and both growing with
load the way a memory-bound server's do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Final, Literal

from tools.sim.kvevents import KvEventsConfig

OutputMode = Literal["random", "echo"]
# vLLM's --kv-transfer-config kv_role: the producer answers prefill-only requests with
# kv_transfer_params, the consumer takes them and skips the prefill; kv_both does either.
KvRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KV_ROLES: Final[tuple[KvRole, ...]] = ("kv_producer", "kv_consumer", "kv_both")
# vLLM's --runner: a server generates (chat, completions) or pools (embeddings, scoring)
Runner = Literal["generate", "pooling"]
# vLLM's --scheduling-policy: first come first served, or by each request's priority
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: Final[tuple[SchedulingPolicy, ...]] = ("fcfs", "priority")

DEFAULT_MODEL: Final = "sim-model"


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Every simulator option; see ``docs/simulator.md`` for what each one models."""

    # -- served model, as vLLM's --model / --served-model-name
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    max_model_len: int = 4096
    runner: Runner = "generate"
    # -- LoRA adapters, as vLLM's --enable-lora (with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1: the
    # load/unload endpoints) and --lora-modules name=path
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 8
    # -- a speech-to-text model (Whisper's kind): /v1/audio/transcriptions and /translations
    audio: bool = False

    # -- scheduler, as vLLM's engine arguments
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_num_queued_reqs: int | None = None  # None: unbounded (vLLM's default)
    # priority: the queue is ordered by (priority, arrival) and preemption takes the least
    # important running request (engine.py); fcfs ignores requests' priorities
    scheduling_policy: SchedulingPolicy = "fcfs"

    # -- KV cache
    block_size: int = 16
    num_gpu_blocks_override: int = 2048  # KV blocks (2048 x 16 = 32,768 tokens)
    enable_prefix_caching: bool = True

    # -- HTTP behaviour switches that vLLM has too
    enable_server_load_tracking: bool = False
    enable_request_id_headers: bool = False
    # usage reports prefix-cache hits (prompt_tokens_details; the Messages API's cache_*)
    enable_prompt_tokens_details: bool = False
    # scale-out endpoints: /v1/*/render, /inference/v1/generate, /inference/v1/abort_requests
    # (403 without, as vLLM's)
    enable_scale_out: bool = False

    # -- step cost model (simulated time)
    step_base_ms: float = 22.0
    prefill_us_per_token: float = 80.0
    decode_us_per_seq: float = 60.0
    attention_ns_per_token: float = 200.0

    # -- disaggregated prefill: None is a server without a KV connector (ignores
    # kv_transfer_params); the transfer cost is the simulator's own
    kv_role: KvRole | None = None
    kv_transfer_us_per_token: float = 20.0

    # -- KV-cache events, as vLLM's --kv-events-config (None: off)
    kv_events: KvEventsConfig | None = None

    # -- output text
    output: OutputMode = "random"
    output_len_min: int = 16  # natural (EOS) length range when ignore_eos is false
    output_len_max: int = 256
    seed: int = 0

    # -- admin endpoint (/sim/*): disabled (404) unless a token is given
    admin_token: str | None = None

    # -- startup: the socket is bound but nothing is answered for this long
    startup_delay_s: float = 0.0

    # -- sleep mode (sleep.py): vLLM's dev routes /sleep, /wake_up, /is_sleeping, served
    # only in dev mode (vLLM's VLLM_SERVER_DEV_MODE=1); waking the weights takes wake_time
    # after level 1, wake_time_level2 after level 2 (seconds, real time)
    dev_mode: bool = False
    wake_time: float = 2.0
    wake_time_level2: float = 6.0
    # GPU memory the model takes (the simulator's own figures): its weights, and its KV
    # cache per token of num_gpu_blocks_override x block_size (a 7B model in fp16: about
    # 13.5 GiB of weights, 512 KiB per token)
    gpu_memory_gib: float = 13.5
    kv_cache_kib_per_token: float = 512.0

    def __post_init__(self) -> None:
        positive = {
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "num_gpu_blocks_override": self.num_gpu_blocks_override,
            "output_len_min": self.output_len_min,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        costs = (
            self.step_base_ms,
            self.prefill_us_per_token,
            self.decode_us_per_seq,
            self.attention_ns_per_token,
        )
        if min(costs) < 0:
            raise ValueError("step cost coefficients must not be negative")
        if self.step_base_ms <= 0:
            raise ValueError("step_base_ms must be positive so that simulated time advances")
        if self.output_len_max < self.output_len_min:
            raise ValueError("output_len_max must not be smaller than output_len_min")
        if self.num_gpu_blocks_override * self.block_size < self.max_model_len:
            # vLLM refuses to start in this case too: one request could never fit.
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the KV cache "
                f"({self.num_gpu_blocks_override} blocks of {self.block_size} tokens)"
            )
        if self.output not in ("random", "echo"):
            raise ValueError(f"output must be 'random' or 'echo', got {self.output!r}")
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 0:
            raise ValueError("max_num_queued_reqs must not be negative")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_transfer_us_per_token < 0:
            raise ValueError("kv_transfer_us_per_token must not be negative")
        self._check_serving()
        self._check_sleep()
        if self.startup_delay_s < 0:
            raise ValueError("startup_delay_s must not be negative")

    def _check_serving(self) -> None:
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"runner must be 'generate' or 'pooling', got {self.runner!r}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        if self.max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        if self.audio and self.runner != "generate":
            raise ValueError("audio needs runner 'generate'")

    def _check_sleep(self) -> None:
        figures = {
            "wake_time": self.wake_time,
            "wake_time_level2": self.wake_time_level2,
            "gpu_memory_gib": self.gpu_memory_gib,
            "kv_cache_kib_per_token": self.kv_cache_kib_per_token,
        }
        for name, value in figures.items():
            if not value >= 0:  # NaN too
                raise ValueError(f"{name} must not be negative, got {value}")

    @property
    def kv_producer(self) -> bool:
        """Answers ``do_remote_decode`` requests with the prefill only."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def kv_consumer(self) -> bool:
        """Takes ``do_remote_prefill`` requests' KV instead of computing the prompt."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def publishes_kv_events(self) -> bool:
        """KV-cache events are recorded and published (``kvevents.py``)."""
        return self.kv_events is not None and self.kv_events.active

    @property
    def model_name(self) -> str:
        """The name clients must send (``--served-model-name``, else ``--model``)."""
        return self.served_model_name or self.model

    def replace(self, **changes: object) -> SimConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
