"""Build a tiny random-weight Llama with its own tokenizer and chat template, for real vLLM tests.

Run with the vLLM virtualenv's interpreter (it needs torch, transformers and tokenizers):

    .venv-vllm/bin/python scripts/build_tiny_model.py [--out .cache/tiny-llama] [--force]

No downloads: the byte-level BPE tokenizer is trained here on a few sentences, and the weights
are drawn from a fixed seed, so the same inputs give the same files. The output is gibberish,
but every part of vLLM's serving path (tokenizer, chat template, scheduler, KV cache, sampler,
detokenizer) is real. The shape is as small as vLLM's CPU attention kernels allow: head
dimension 64 (16 is rejected), 2 layers. A directory already built from the same spec is left
alone unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parent.parent
DEFAULT_OUT: Final = ROOT / ".cache" / "tiny-llama"
STAMP: Final = "build-info.json"
SEED: Final = 1234

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
VOCAB_SIZE: Final = 512
# max_position_embeddings bounds vLLM's --max-model-len: long enough that a request with a
# large max_tokens is still generating when a test cancels it.
MODEL: Final[dict[str, Any]] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}

CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CORPUS: Final = [
    "The gateway routes every request to the least loaded backend serving its model.",
    "Tokens stream through as they are generated, one server-sent event at a time.",
    "When a client goes away, the upstream connection closes and the engine aborts.",
    "A quick brown fox jumps over the lazy dog while the scheduler batches requests.",
    "Prefix caching reuses the key and value blocks of prompts that share a beginning.",
    "Hello, world! How are you today? I am fine, thank you. 0123456789",
    "system user assistant: answer briefly and politely, in plain English.",
]


def spec_digest() -> str:
    spec = {
        "model": MODEL,
        "vocab": VOCAB_SIZE,
        "seed": SEED,
        "template": CHAT_TEMPLATE,
        "corpus": CORPUS,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def already_built(out: Path, digest: str) -> bool:
    stamp = out / STAMP
    if not stamp.is_file():
        return False
    try:
        return bool(json.loads(stamp.read_text()).get("spec") == digest)
    except ValueError:
        return False


def train_tokenizer() -> Any:
    """The byte-level BPE tokenizer, trained on ``CORPUS`` (needs only ``tokenizers``: the
    gateway's tests build the same one without transformers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def build_tokenizer(out: Path) -> int:
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MODEL["max_position_embeddings"],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(out)
    return int(tok.get_vocab_size())


def build_model(out: Path, vocab_size: int) -> int:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(out)
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="bfloat16",
        **MODEL,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    out: Path = args.out
    digest = spec_digest()
    start = time.monotonic()
    if not args.force and already_built(out, digest):
        print(f"build_tiny_model: {out} is up to date ({time.monotonic() - start:.1f} s)")
        return 0
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab = build_tokenizer(tmp)
    params = build_model(tmp, vocab)
    (tmp / STAMP).write_text(json.dumps({"spec": digest, "vocab": vocab, "params": params}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(
        f"build_tiny_model: wrote {out} (vocab {vocab}, {params:,} parameters) "
        f"in {time.monotonic() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
