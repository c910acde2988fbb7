"""What computing a request's prompt token ids costs the gateway (gateway/tokenizer/).

For completions (encoding the prompt) and chats (parsing the messages, rendering the chat
template, encoding the text), with a short prompt (~200 tokens) and a long one (~8k tokens),
prints the time per call and per 1,000 prompt tokens, then what handing a long prompt to
``Tokenizers``' thread pool adds (the hop, measured with a tokenizer that does nothing).
Figures only, no assertions: they depend on the machine.

The default tokenizer is the tiny test model's (``.cache/tiny-llama``; built with the vLLM
virtualenv's ``scripts/build_tiny_model.py`` when missing, else with the tests' builder in a
temporary directory). Its byte-level BPE has a 512-token vocabulary, so it cuts text into
many more tokens per character than a real model's 32k-200k vocabulary does: per 1,000
tokens its figures are comparable, per character they are not. ``--model-dir`` points at a
real model directory (tokenizer.json, tokenizer_config.json, the chat template) instead.

Run: ``.venv/bin/python -m loadtest.bench.tokenize [--model-dir DIR] [--seconds 1.0]``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from gateway.tokenizer import HfTokenizer, PathKind, Tokenizers, prompt_chars

ROOT: Final = Path(__file__).resolve().parents[2]
TINY_MODEL: Final = ROOT / ".cache" / "tiny-llama"
SHORT_TOKENS: Final = 200
LONG_TOKENS: Final = 8_000
PROSE: Final = (
    "The gateway routes every request to the backend most likely to hold its prompt in the "
    "prefix cache. Tokens stream through as they are generated, one server-sent event at a "
    "time, and when a client goes away the upstream connection closes and the engine aborts "
    "the request. Operators read the figures on a dashboard: latency percentiles, queue "
    "depths, cache hit rates, the share of requests that were retried. A quick brown fox "
    "jumps over the lazy dog while the scheduler batches requests of many lengths together; "
    "long documents, short questions, code with indentation and symbols like {}, [], <>, "
    "and numbers such as 3.14159 or 2024-06-01.\n"
)


def tiny_model_dir() -> Path:
    """The tiny model's directory, built if missing (the vLLM venv, else the tests' builder)."""
    if (TINY_MODEL / "tokenizer.json").is_file():
        return TINY_MODEL
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if python.is_file():
        done = subprocess.run(
            [str(python), str(ROOT / "scripts" / "build_tiny_model.py"), "--out", str(TINY_MODEL)],
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
        )
        if done.returncode == 0 and (TINY_MODEL / "tokenizer.json").is_file():
            return TINY_MODEL
        print(f"bench_tokenize: building the tiny model failed:\n{done.stderr[-1000:]}")
    # Imported by name: the tests are not part of the installed package (nor type-checked
    # with it), and this fallback only runs from a checkout.
    tests = importlib.import_module("tests.gateway.tokenizer.test_tokenizer")
    out = Path(tempfile.mkdtemp(prefix="bench-tokenize-")) / "tiny"
    print(f"bench_tokenize: using the tests' builder ({out})")
    built: Path = tests.build_tiny_tokenizer(out)
    return built


def text_of(tok: HfTokenizer, tokens: int) -> str:
    """Prose cut to about ``tokens`` tokens under this tokenizer."""
    per_copy = len(tok.encode(PROSE, add_special_tokens=False))
    text = PROSE * (tokens // per_copy + 2)
    low, high = 0, len(text)
    while low < high:  # the longest prefix with at most `tokens` tokens
        mid = (low + high + 1) // 2
        if len(tok.encode(text[:mid], add_special_tokens=False)) <= tokens:
            low = mid
        else:
            high = mid - 1
    return text[:low]


def chat_body(tok: HfTokenizer, tokens: int) -> dict[str, Any]:
    """A system prompt, a past exchange and a question, about ``tokens`` tokens in all."""
    return {
        "messages": [
            {"role": "system", "content": text_of(tok, tokens * 7 // 10)},
            {"role": "user", "content": text_of(tok, tokens // 10)},
            {"role": "assistant", "content": text_of(tok, tokens // 10)},
            {"role": "user", "content": [{"type": "text", "text": text_of(tok, tokens // 10)}]},
        ]
    }


def per_call_us(fn: Callable[[], object], seconds: float) -> float:
    """Median of batches' µs per call, over about ``seconds``."""
    fn()  # warm: compiled template, caches
    start = time.perf_counter()
    fn()
    one = max(time.perf_counter() - start, 1e-7)
    batch = max(1, int(0.02 / one))
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(samples) < 5:
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - t0) / batch * 1e6)
    return statistics.median(samples)


class _Nothing:
    """A PromptTokenizer that does no work: what is left is the pool's hop."""

    name = "nothing"
    kind = "bench"

    def prompt_tokens(self, path_kind: PathKind, doc: Mapping[str, Any]) -> list[int] | None:
        return [0]


async def pool_hop_us(seconds: float) -> float:
    tokenizers = Tokenizers({"m": _Nothing()}, inline_chars=0)
    doc = {"prompt": "x"}
    try:
        await tokenizers.tokens("m", "completions", doc)
        samples: list[float] = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(samples) < 50:
            t0 = time.perf_counter()
            await tokenizers.tokens("m", "completions", doc)
            samples.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(samples)
    finally:
        tokenizers.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="a model directory (default: tiny model)")
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    args = parser.parse_args(argv)
    directory: Path = args.model_dir or tiny_model_dir()
    tok = HfTokenizer.from_path(directory)
    print(f"tokenizer: {tok.name}")
    if not tok.has_chat_template:
        print("bench_tokenize: the model has no chat template; chat rows are skipped")
    header = (
        f"{'path':<12} {'prompt':<6} {'tokens':>7} {'chars':>8} {'µs/call':>10} {'µs/1k tok':>10}"
    )
    print(header)
    print("-" * len(header))
    for label, target in (("short", SHORT_TOKENS), ("long", LONG_TOKENS)):
        bodies: list[tuple[PathKind, dict[str, Any]]] = [
            ("completions", {"prompt": text_of(tok, target)})
        ]
        if tok.has_chat_template:
            bodies.append(("chat", chat_body(tok, target)))
        for path_kind, body in bodies:
            ids = tok.prompt_tokens(path_kind, body)
            if ids is None:
                print(f"{path_kind:<12} {label:<6} cannot be tokenized")
                continue
            chars = prompt_chars(path_kind, body)

            def call(p: PathKind = path_kind, b: dict[str, Any] = body) -> object:
                return tok.prompt_tokens(p, b)

            us = per_call_us(call, args.seconds)
            print(
                f"{path_kind:<12} {label:<6} {len(ids):>7,} {chars:>8,} {us:>10,.1f} "
                f"{us / len(ids) * 1000:>10,.1f}"
            )
    hop = asyncio.run(pool_hop_us(args.seconds))
    print(f"\nthread-pool hop (Tokenizers.tokens of a long prompt, minus the work): {hop:,.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
