"""Capacity planning for vLLM deployments (``llm-gateway plan``).

``model`` reads the architecture, ``arithmetic`` holds the memory formulas, ``planner``
chooses the tensor-parallel size and engine arguments, ``render`` prints the result and
``cli`` wires it to the command line.
"""
