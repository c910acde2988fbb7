"""A request's prompt token ids, computed in the gateway exactly as the backend computes them.

Routing by the KV blocks each vLLM backend holds in its prefix cache (``policies/kv_index.py``)
needs the request's prompt as the token ids the engine will see. One token of difference at
position ``i`` changes the key of every block from ``i`` on, so a close guess is worth nothing:
each tokenizer here either reproduces the backend's ids exactly or answers ``None`` ("cannot
say faithfully"), and the caller falls back to routing without them.

- ``PromptTokenizer`` (``protocol.py``): the protocol. ``prompt_tokens(path_kind, doc)`` never
  raises on client input: a body vLLM would reject, or one this package cannot reproduce
  (several prompts, images or audio, a request-supplied chat template, truncation, ...), gives
  ``None``.
- ``HfTokenizer`` (``hf.py``): a Hugging Face model directory (or a bare ``tokenizer.json``),
  tokenized with ``tokenizers`` and chat-rendered with ``jinja2`` the way vLLM 0.32's
  ``HfRenderer`` does it with transformers 5 (both read from ``.venv-vllm``; the comments name
  each function followed). The model's tokenizer must be a fast tokenizer
  (``tokenizer.json``), as vLLM uses for it; Mistral's own format (``tekken.json``) and
  gpt-oss's Harmony chats are not. Its parts: the model directory's files (``hf_load.py``),
  the messages as the template sees them (``messages.py``), the template's compilation and
  rendering (``chat_template.py``).
- ``SimTokenizer`` (``sim.py``): the simulator's word tokenizer (``words.py``, which the
  simulator imports from here), as ``tools/sim/protocol.py`` computes a prompt.
- ``load_tokenizer(spec)`` (``pool.py``): ``"sim"`` or a path, with start-up errors an operator
  can act on.
- ``Tokenizers`` (``pool.py``): one tokenizer per model, behind an async ``tokens()`` that
  tokenizes short prompts inline and long ones in a small, bounded thread pool, so a
  100k-character prompt does not stall the event loop and a flood of them does not queue
  unbounded work.
"""

from gateway.tokenizer.chat_template import ContentFormat
from gateway.tokenizer.chat_template import _template as _template  # tests compile templates
from gateway.tokenizer.hf import HfTokenizer
from gateway.tokenizer.pool import (
    DEFAULT_INLINE_CHARS,
    Tokenizers,
    TokenizerStats,
    load_tokenizer,
    prompt_chars,
)
from gateway.tokenizer.protocol import PathKind, PromptTokenizer
from gateway.tokenizer.sim import SimTokenizer

__all__ = [
    "DEFAULT_INLINE_CHARS",
    "ContentFormat",
    "HfTokenizer",
    "PathKind",
    "PromptTokenizer",
    "SimTokenizer",
    "TokenizerStats",
    "Tokenizers",
    "load_tokenizer",
    "prompt_chars",
]
