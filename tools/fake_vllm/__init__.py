"""The one fake vLLM: a small aiohttp imitation of ``vllm serve``, scripted by the tests and
run as a process by the benchmarks.

- ``backend``: ``FakeBackend``, the server (vLLM's routes; the completion endpoints answered
  by a ``behaviour``; what it saw, in ``seen``) and ``running_fake``, which serves one on
  loopback for a test;
- ``vllm``: vLLM's own answers in vLLM's bytes, paced (first token after ``ttft``, then one
  per ``itl``) or as fast as it can;
- ``scripted``: the tests' behaviours (stream and hold, an error, hang before the head) and
  the SSE chunks they are made of;
- ``serve``: ``python -m tools.fake_vllm``, the benchmarks' process.

It imports nothing but aiohttp (and uvloop when it runs as a process), so the peer bench runs
it under a Python that need not hold the gateway's dependencies. ``loadtest.counting`` adds the
counting "model" for the tests of stream continuation. The simulator (``tools.sim``) is the
other backend the tests run: an engine model, for what depends on scheduling and caches.
"""

from tools.fake_vllm.backend import (
    Behaviour,
    FakeBackend,
    Seen,
    bound_socket,
    echo_json,
    kill,
    running_fake,
)
from tools.fake_vllm.scripted import answer, chat_chunk, hang_before_headers, sse, stream_chat
from tools.fake_vllm.serve import create_app
from tools.fake_vllm.vllm import vllm

__all__ = [
    "Behaviour",
    "FakeBackend",
    "Seen",
    "answer",
    "bound_socket",
    "chat_chunk",
    "create_app",
    "echo_json",
    "hang_before_headers",
    "kill",
    "running_fake",
    "sse",
    "stream_chat",
    "vllm",
]
