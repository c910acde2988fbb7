"""The peer bench: what an LLM gateway costs when it forwards SSE token streams, side by side
with other gateways (nginx, vllm-router, sglang-router, LiteLLM), with the floors of
``scripts/proxy_cost`` and with no gateway at all.

- ``loadgen``: its closed-loop streaming load generator;
- ``targets``: what it runs (command templates) and the two backend profiles;
- ``procs``: processes pinned to a CPU, their CPU time and RSS from ``/proc``;
- ``driver``: one target through both profiles and every concurrency level;
- ``report``: the markdown page of a run; ``cli``: ``python -m loadtest.peers``.

The fake vLLM backends are the repository's one fake (``tools.fake_vllm``, paced or as fast as
it can). They and the load generator run under any Python with aiohttp and uvloop (the fake as
``PYTHONPATH=<checkout> python -m tools.fake_vllm``, the load generator as a file,
``python loadtest/peers/loadgen.py``), so a bench Python need not hold the gateway's
dependencies.
"""
