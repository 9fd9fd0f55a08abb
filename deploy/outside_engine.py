"""How long requests spend outside the engine before their first token, as the ingress sees it.

A request's time to first token at the ingress is the engine's own (from its arrival at the
replica to the step that sampled its first token: `RequestOutput.arrival_time` and
`first_token_time`) plus the path outside it: the ingress's work after tenant admission,
the Ray handle to the replica and the first chunk's way back. SLO-aware admission
(replica/slo_admission.py) leaves room for that path in the objective, so the ingress
measures it on its recent requests and sends a high percentile with each request
(`TenantShare.ttft_outside_engine_s`). The path before the ingress (the HTTP proxy, parsing,
tokenizing) is not seen here: the admission's headroom covers it.
"""

from __future__ import annotations

from collections import deque

from iterserve.autoscale.percentile import percentile

SAMPLES = 128  # recent requests kept: a few seconds of traffic under load
QUANTILE = 90.0  # a high percentile, not the mean: the objective is a per-request bound


class OutsideEngineMeter:
    """The ingress's recent outside-the-engine times; `estimate_s` is their p90 (0.0 with
    none yet). Every coroutine of the ingress runs on one event loop: no lock."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=SAMPLES)
        self._estimate = 0.0

    def record(self, ingress_ttft_s: float, engine_ttft_s: float) -> None:
        """One request's first token: seen after ingress_ttft_s at the ingress, sampled
        engine_ttft_s after it reached the engine (clock skew never makes it negative)."""
        self._recent.append(max(0.0, ingress_ttft_s - engine_ttft_s))
        self._estimate = percentile(list(self._recent), QUANTILE)

    def estimate_s(self) -> float:
        return self._estimate
