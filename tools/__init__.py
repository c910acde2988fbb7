"""Tools around the gateway: the vLLM simulator, a fake vLLM, the planner, ``top``,
``kv-events check``, the demo."""
