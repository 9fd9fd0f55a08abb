"""A request's tenant side: its cache namespace, its quota lease and its metrics.

`Tenancy` is the ingress's (built once with the app): the quota gate, the per-tenant metrics
and whether tenants' caches are isolated. `Tenancy.begin` turns a caller and a request into
a `TenantRequest` (or a 429 over quota); `TenantRequest.meter` wraps the request's engine
stream, counting the tokens it yields, and when the stream ends (finished, failed or cut by
the client) releases the lease with the tokens actually served and records the metrics.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar

from iterserve.dashboards.tenant_metrics import TenantMetrics
from iterserve.deploy.outside_engine import OutsideEngineMeter
from iterserve.deploy.quota_ledger import Admission
from iterserve.deploy.quotas import LocalQuotas, QuotaGate, rate_limit_headers, rate_limited
from iterserve.deploy.tenants import DEFAULT, Caller
from iterserve.replica.block_keys import CacheNamespace
from iterserve.replica.outputs import RequestOutput
from iterserve.replica.request import TenantShare

Item = TypeVar("Item", bound=tuple[int, RequestOutput])


@dataclass
class TenantRequest:
    """One request's tenant side (see the module docstring)."""

    caller: Caller
    cache_namespace: CacheNamespace
    prompt_tokens: int
    quotas: QuotaGate | None = None
    admission: Admission | None = None
    metrics: TenantMetrics | None = None
    outside: OutsideEngineMeter | None = None
    started: float = field(default_factory=time.perf_counter)

    @property
    def share(self) -> TenantShare:
        """Whom the engine serves it for: the tenant and its weight (the fair policy), its
        TTFT objective and the time outside the engine the objective must leave room for."""
        tenant = self.caller.tenant
        outside = self.outside.estimate_s() if self.outside is not None else 0.0
        return TenantShare(tenant.name, tenant.weight, tenant.ttft_slo_ms, outside)

    def band(self, priority: int) -> int:
        """The engine priority of a request asking for `priority`: a keys-file tenant's never
        ahead of its tenant's band (lower runs first), so its client may only lower its own
        importance; the default tenant's (no keys file, or a plain key) as asked, as before."""
        tenant = self.caller.tenant
        return priority if tenant.name == DEFAULT.name else max(priority, tenant.priority)

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers where the tenant has quotas; else none."""
        return rate_limit_headers(self.admission) if self.admission is not None else {}

    async def meter(self, stream: AsyncIterator[Item]) -> AsyncIterator[Item]:
        """The stream as is; when it ends, the lease released and the metrics recorded.
        Closing this generator closes `stream` (the engine requests are aborted)."""
        generated = 0
        first = True
        try:
            async for item in stream:
                count = len(item[1].new_token_ids)
                if first and count:
                    first = False
                    self._record_first_token(item[1])
                generated += count
                yield item
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            self.finish(generated)

    def _record_first_token(self, output: RequestOutput) -> None:
        ttft = time.perf_counter() - self.started
        if self.metrics is not None:
            self.metrics.record_first_token(self.caller.tenant.name, ttft)
        if self.outside is not None and output.first_token_time is not None:
            self.outside.record(ttft, output.first_token_time - output.arrival_time)

    def finish(self, generated: int) -> None:
        """Release the lease (the tokens served: prompt + generated) and count the tokens;
        once: a second call does nothing."""
        if self.admission is not None and self.admission.lease_id is not None \
                and self.quotas is not None:
            self.quotas.release(self.admission.lease_id, self.prompt_tokens + generated)
            self.quotas = None
        if self.metrics is not None:
            self.metrics.record_tokens(self.caller.tenant.name, self.prompt_tokens, generated)
            self.metrics = None


@dataclass(frozen=True)
class Tenancy:
    """The ingress's tenant services (see the module docstring)."""

    quotas: QuotaGate = field(default_factory=LocalQuotas)
    metrics: TenantMetrics | None = None
    cache_isolation: bool = True
    outside: OutsideEngineMeter = field(default_factory=OutsideEngineMeter)

    async def begin(self, caller: Caller | None, cache_salt: str | None, prompt_tokens: int,
                    max_tokens: int) -> TenantRequest:
        """The request's tenant side once admitted; a 429 (OpenAIHTTPError) over quota.
        max_tokens: what its choices may generate in all (n x max_tokens)."""
        caller = caller or Caller(DEFAULT)
        tenant = caller.tenant
        namespace = caller.cache_namespace(self.cache_isolation, cache_salt)
        request = TenantRequest(caller, namespace, prompt_tokens, metrics=self.metrics,
                                outside=self.outside)
        if tenant.quota.limited:
            charge = prompt_tokens + max_tokens
            admission = await self.quotas.admit(tenant, charge)
            if not admission.admitted:
                if self.metrics is not None:
                    self.metrics.record_request(tenant.name, "rate_limited")
                raise rate_limited(admission, tenant, charge)
            request.quotas, request.admission = self.quotas, admission
        if self.metrics is not None:
            self.metrics.record_request(tenant.name, "admitted")
        return request
