"""Download $MODEL's files into the Hugging Face cache for compose.yaml's vLLM services.

Those servers sit on the `engines` network, which has no way out (their dev routes answer
without a key, so nothing but the gateway and Prometheus may reach them, and they reach
nothing either). They load the model offline (HF_HUB_OFFLINE=1) from the `hf-cache` volume,
which this one-shot service, run by compose before them on the ordinary network, fills.

It fetches what vLLM reads: the configuration and tokenizer files, and a single format of
weights (safetensors when the repository has them, as vLLM prefers; else .bin, else .pt). A
second run finds the files in the cache and downloads nothing. A local directory
(MODEL=/models/...) needs no download. Runs inside the vLLM image, with its huggingface_hub.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Final

from huggingface_hub import list_repo_files, snapshot_download

# Weights vLLM would read, most preferred first: only the first one a repository has is fetched.
WEIGHT_FORMATS: Final = (".safetensors", ".bin", ".pt")
# What vLLM never loads for a Hugging Face model: other frameworks' formats and the original
# (consolidated) checkpoints that some repositories carry beside the converted ones.
NEVER: Final = ("original/*", "*.gguf", "*.onnx", "*.msgpack", "*.h5", "*.ot", "*.tflite")


def ignored(files: list[str]) -> list[str]:
    """Patterns of the files to skip: the never-loaded ones, and all but one weight format."""
    present = [fmt for fmt in WEIGHT_FORMATS if any(f.endswith(fmt) for f in files)]
    return [*NEVER, *(f"*{fmt}" for fmt in present[1:])]


def main() -> int:
    model = os.environ["MODEL"]
    if Path(model).is_dir():
        print(f"vllm-weights: {model} is a local directory; nothing to download", file=sys.stderr)
        return 0
    path = snapshot_download(model, ignore_patterns=ignored(list_repo_files(model)))
    print(f"vllm-weights: {model} in {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
