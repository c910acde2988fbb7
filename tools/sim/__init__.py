"""A vLLM-compatible backend simulator: vLLM 0.32's HTTP surface over a simulated engine.

``llm-gateway sim --port 8001`` runs one; tests use ``running_sim``. See
``docs/simulator.md``.
"""

from tools.sim.config import SimConfig
from tools.sim.faults import Faults
from tools.sim.runner import SimServer
from tools.sim.server import create_app
from tools.sim.testing import FAST, RunningSim, running_sim

__all__ = ["FAST", "Faults", "RunningSim", "SimConfig", "SimServer", "create_app", "running_sim"]
