"""An engine's rest: awake, going to sleep, asleep or waking. Pure.

Two facts make it: whether the fleet wants the engine asleep (``sleep_wanted``: the capacity
manager's decision, or an operator's, applied from the fleet's log on every replica) and
whether it was last seen asleep (``asleep``: vLLM's ``GET /is_sleeping``, or its
``vllm:engine_sleep_state`` gauge; None while not known). The manager moves the second towards
the first (``POST /sleep`` once the engine is idle, ``POST /wake_up``); the request path routes
only to an engine that is awake on both counts. A restarted engine comes back awake whatever
was wanted: it is then "going to sleep" again, and the manager finishes the job, so nothing is
believed asleep that is awake, or the reverse.
"""

from __future__ import annotations

from enum import Enum


class Rest(Enum):
    AWAKE = "awake"
    GOING_TO_SLEEP = "going_to_sleep"  # wanted asleep, still awake: no new work, finishing
    ASLEEP = "asleep"
    WAKING = "waking"  # wanted awake, still asleep

    @property
    def routable(self) -> bool:
        return self is Rest.AWAKE


def rest_of(sleep_wanted: bool, asleep: bool | None) -> Rest:
    if sleep_wanted:
        return Rest.ASLEEP if asleep else Rest.GOING_TO_SLEEP
    return Rest.WAKING if asleep else Rest.AWAKE
