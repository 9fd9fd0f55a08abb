"""A simulated replica's side of tenancy: each request's tenant fields, and SLO admission.

The fields are the ones the ingress carries to the engine (tenant, weight, priority band),
so the engine's own policy objects order the replica's waiting queue. SLO admission is the
engine's own check (`replica/slo_admission.check_ttft_slo`, the prediction and the refusal
alike), fed what the engine feeds it: its unfinished requests, its band's recently admitted
tenants (`ActiveTenants`), and its drain rate, measured as `engine_stats` measures it
(prompt tokens per second of busy time between prefilling steps; here busy time is step
time, since a simulated replica runs its steps back to back while it has work). The time
outside the engine is the cluster's constant Ray-path latency (dispatch + stream).
"""

from __future__ import annotations

from iterserve.autoscale.sim.tenancy import SimTenancy
from iterserve.replica.prefill_rate import PrefillRateMeter
from iterserve.replica.request import Request
from iterserve.replica.scheduler import Scheduler
from iterserve.replica.slo_admission import ActiveTenants, DrainRate, check_ttft_slo


class TenantAdmission:
    """One replica's: tags requests with their tenant and refuses the ones predicted late."""

    def __init__(self, tenancy: SimTenancy, outside_engine_s: float) -> None:
        self.tenancy = tenancy
        self.outside_engine_s = outside_engine_s
        self.active = ActiveTenants()
        self.drain = PrefillRateMeter()
        self._busy_since: float | None = None

    def admit(self, request: Request, tenant_name: str | None, scheduler: Scheduler,
              now: float) -> None:
        """Give the request its tenant's fields; with slo_admission, raise
        SLOUnreachableError (nothing is queued) when it is predicted to miss its objective."""
        tenant = self.tenancy.tenant(tenant_name)
        request.tenant, request.tenant_weight = tenant.name, tenant.weight
        request.priority = tenant.priority
        if not self.tenancy.slo_admission:
            return
        share = tenant.share(self.outside_engine_s)
        drain = DrainRate(self.drain.rate(now), self.drain.mean_seconds(now))
        check_ttft_slo(scheduler.unfinished_requests(), request.num_prompt_tokens,
                       tenant.priority, share, scheduler.counters is not None, drain,
                       self.active.of_band(tenant.priority, now), self.tenancy.slo_headroom)
        self.active.admitted(tenant.priority, share, now)

    def step_ended(self, start: float, end: float, prefill_tokens: int) -> None:
        """A step [start, end] computed prefill_tokens prompt tokens."""
        if prefill_tokens:
            busy_from = start if self._busy_since is None else self._busy_since
            self.drain.record(end, prefill_tokens, end - busy_from)
            self._busy_since = end
        elif self._busy_since is None:
            self._busy_since = start

    def went_idle(self) -> None:
        """No work left: the time until the next request is not busy time."""
        self._busy_since = None
