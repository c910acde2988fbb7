"""Capacity follows demand: idle engines put to sleep, woken ahead of the peak (docs/capacity.md).

- ``plan``: what to wake and what to put to sleep, from demand and the engines' states (pure);
- ``demand``: a model's demand and its trend over time (pure);
- ``book``: the rules and the manager's fencing token, as the fleet's log left them;
- ``manager``: the one replica at a time (a lease) that decides, through the log, and calls
  the engines' ``/sleep`` and ``/wake_up``;
- ``hold``: requests for a model with no awake engine held while one wakes;
- ``settings``: ``[capacity]``;
- ``wiring``: its place in the gateway (``gateway.root``): the requests held for a wake, the
  manager.

The engines' states themselves (awake, going to sleep, asleep, waking) are the pool's
(``backends.sleep``): the request path routes only to awake ones.
"""
