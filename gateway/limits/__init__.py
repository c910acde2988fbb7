"""API keys, rate limits (in memory or shared through Redis) and the admission queue.

The request path uses ``Limiter`` (authenticate, admit, finish) and ``AdmissionQueue`` (wait
while the fleet is saturated); see docs/limits.md.
"""

from gateway.limits.admission import AdmissionQueue, AdmissionTicket
from gateway.limits.fairqueue import SaturationThresholds, fleet_saturated, parse_priority
from gateway.limits.keys import Authenticator, Principal, hash_key
from gateway.limits.limiter import Grant, Limiter, make_store, open_limiter
from gateway.limits.settings import LimitsSettings
from gateway.limits.store import LimitDecision, Limits, LimitStore, Ticket
from gateway.limits.tokens import UsageFilter, usage_from_body, usage_plan, with_include_usage

__all__ = [
    "AdmissionQueue",
    "AdmissionTicket",
    "Authenticator",
    "Grant",
    "LimitDecision",
    "LimitStore",
    "Limiter",
    "Limits",
    "LimitsSettings",
    "Principal",
    "SaturationThresholds",
    "Ticket",
    "UsageFilter",
    "fleet_saturated",
    "hash_key",
    "make_store",
    "open_limiter",
    "parse_priority",
    "usage_from_body",
    "usage_plan",
    "with_include_usage",
]
