"""Per-tenant metrics, recorded by the ingress: requests (admitted or rate limited), prompt
and generated tokens, time to first token.

A tenant name is a label value, and label values must stay few (each is a series in every
Prometheus that scrapes us): the first `max_tenants` tenants seen by this process keep their
own label for good (a series never changes meaning), every later one is counted as
"other". Sub-tenants are counted under their tenant: OpenAI's `user` field is unbounded.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from iterserve.dashboards.metrics import (
    LABEL_MODEL,
    LABEL_OUTCOME,
    LABEL_TENANT,
    METRIC_PREFIX,
    TENANT_GENERATION_TOKENS,
    TENANT_PROMPT_TOKENS,
    TENANT_REQUESTS,
    TENANT_TIME_TO_FIRST_TOKEN,
)
from iterserve.dashboards.sinks import get_sink

OTHER_TENANTS = "other"
DEFAULT_MAX_TENANT_LABELS = 32
TENANT_OUTCOMES = ("admitted", "rate_limited")


class TenantLabels:
    """The label value of each tenant: its name for the first `max_tenants` seen, then
    "other"."""

    def __init__(self, max_tenants: int = DEFAULT_MAX_TENANT_LABELS) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self._max = max_tenants
        self._named: set[str] = set()

    def label(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        if len(self._named) < self._max and tenant != OTHER_TENANTS:
            self._named.add(tenant)
            return tenant
        return OTHER_TENANTS


class TenantMetrics:
    """The ingress's per-tenant counters and TTFT histogram, under the metric prefix."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, *,
                 backend: str | None = None, prefix: str = METRIC_PREFIX,
                 max_tenants: int = DEFAULT_MAX_TENANT_LABELS) -> None:
        self._sink = get_sink(prefix, registry, backend)
        self._model_name = model_name
        self._labels = TenantLabels(max_tenants)

    def _of(self, tenant: str) -> dict[str, str]:
        return {LABEL_MODEL: self._model_name, LABEL_TENANT: self._labels.label(tenant)}

    def record_request(self, tenant: str, outcome: str) -> None:
        if outcome not in TENANT_OUTCOMES:
            raise ValueError(f"outcome must be one of {TENANT_OUTCOMES}, got {outcome!r}")
        self._sink.counter_inc(TENANT_REQUESTS, 1.0, {**self._of(tenant), LABEL_OUTCOME: outcome})

    def record_first_token(self, tenant: str, ttft_s: float) -> None:
        self._sink.histogram_observe(TENANT_TIME_TO_FIRST_TOKEN, ttft_s, self._of(tenant))

    def record_tokens(self, tenant: str, prompt_tokens: int, generation_tokens: int) -> None:
        labels = self._of(tenant)
        self._sink.counter_inc(TENANT_PROMPT_TOKENS, float(prompt_tokens), labels)
        self._sink.counter_inc(TENANT_GENERATION_TOKENS, float(generation_tokens), labels)
