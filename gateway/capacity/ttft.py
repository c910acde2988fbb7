"""Each model's recent time to first token, as this replica saw it: the 90th percentile of the
requests answered since the last look, from the gateway's own histogram
(``llm_gateway_time_to_first_token_seconds``, by model and backend). The capacity manager wakes
one more engine while it is over the model's objective (``Rule.ttft_slo``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import Metric

from gateway.fleet.figures import quantile

BUCKET = "llm_gateway_time_to_first_token_seconds_bucket"


class RecentTtft:
    def __init__(self, families: Callable[[], Iterable[Metric]], q: float = 0.9) -> None:
        self._families = families
        self._q = q
        self._then: dict[str, dict[float, float]] = {}

    def look(self) -> dict[str, float]:
        """Per model, the quantile of those answered since the last look (none: left out)."""
        now: dict[str, dict[float, float]] = {}
        for family in self._families():
            for s in family.samples:
                if s.name == BUCKET:
                    model, le = s.labels.get("model", ""), float(s.labels["le"])
                    counts = now.setdefault(model, {})
                    counts[le] = counts.get(le, 0.0) + s.value
        seen: dict[str, float] = {}
        for model, counts in now.items():
            then = self._then.get(model, {})
            window = sorted((le, max(0.0, n - then.get(le, 0.0))) for le, n in counts.items())
            if window and window[-1][1] > 0:
                q = quantile(window, self._q)
                if q is not None:
                    seen[model] = q
        self._then = now
        return seen
