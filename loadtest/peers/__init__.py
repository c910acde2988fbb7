"""The peer bench: what an LLM gateway costs when it forwards SSE token streams, side by side
with other gateways (nginx, vllm-router, sglang-router, LiteLLM), with the floors of
``scripts/proxy_cost`` and with no gateway at all.

- ``fake_backend``: the bench's fake vLLM (paced or as fast as it can);
- ``loadgen``: its closed-loop streaming load generator;
- ``targets``: what it runs (command templates) and the two backend profiles;
- ``procs``: processes pinned to a CPU, their CPU time and RSS from ``/proc``;
- ``driver``: one target through both profiles and every concurrency level;
- ``report``: the markdown page of a run; ``cli``: ``python -m loadtest.peers``.

The fake backend and the load generator run as files (``python loadtest/peers/loadgen.py``)
under any Python with aiohttp and uvloop, so a bench Python need not hold the repository.
"""
