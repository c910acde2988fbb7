"""Why the gateway ends an attempt's wait for its backend: the causes it names to the transport
(``backends.upstream.client.Interrupt.end``), each the error the attempt then ends with.

- ``marked_down``: the health probes marked the backend down while the request waited for it
  (the lease's down signal, ``gateway.request.send``);
- ``first_token_late``: no first token by the policy's deadline (the rescue, or the hedge's
  trigger: ``gateway.request.call.rescue_now`` confirms it);
- ``outrun``: a rival attempt racing for the same client answered first (``gateway.request.hedge``).
"""

from __future__ import annotations

from backends.errors import BackendDown, FirstTokenLate


def marked_down(backend: str) -> BackendDown:
    return BackendDown(
        f"backend {backend}: marked down by its health probes while the request waited"
    )


def first_token_late(backend: str, within: float) -> FirstTokenLate:
    return FirstTokenLate(f"backend {backend}: no first token within {within:.2f} s")


def outrun(backend: str) -> FirstTokenLate:
    return FirstTokenLate(f"backend {backend}: another backend's first token came first")
