"""A vLLM-compatible backend simulator: vLLM 0.32's HTTP surface over a simulated engine.

``llm-gateway sim --port 8001`` runs one; tests use ``running_sim``. See
``docs/simulator.md``.
"""

from backends.sim.config import SimConfig
from backends.sim.faults import Faults
from backends.sim.runner import SimServer
from backends.sim.server import create_app
from backends.sim.testing import FAST, RunningSim, running_sim

__all__ = ["FAST", "Faults", "RunningSim", "SimConfig", "SimServer", "create_app", "running_sim"]
