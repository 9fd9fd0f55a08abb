"""SLO-aware admission: refuse at once a request predicted to miss its tenant's TTFT objective.

A request is admitted only when its predicted time to first token is within
`slo_admission_headroom` (a fraction, SchedulerConfig) of its tenant's `ttft_slo_ms`: the
prediction is an estimate, and admitting right up to the objective puts every error over
the line (loadtests/studies/fair_share: 2-4 % of the admitted met a 2 s objective so). The
prediction is the sum of

* the time outside the engine before its first token (ingress, handle, streaming), as the
  ingress measured it on its recent requests (`TenantShare.ttft_outside_engine_s`,
  deploy/outside_engine.py);
* one step: the first token comes out only when the step that computes the prompt's last
  token ends, and the step in flight when the request arrives must end first (the mean
  wall time between the engine's recent prefilling steps);
* the prefill work ahead of it, its own prompt included, drained at the replica's measured
  rate: prompt tokens per second of wall time while work was pending
  (`EngineStatsReporting.prefill_drain_rate`; not the prefill_token_rate routers read, per
  second of step time, which leaves out the engine loop's time between steps and the
  decode-only steps a queued request waits through too).

The work ahead is every uncomputed prompt token of the admitted requests (running and
waiting) of a more important band (lower priority value), and of its own band under the
fcfs and priority policies (arrival order: all of them came first). Under the fair policy
its band is shared as VTC shares it: its own tenant's queued prompts and its own prompt
drain at the tenant's weighted share of the rate, its weight over the summed weights of the
band's active tenants (those with a request admitted now, or admitted within
ACTIVE_WINDOW_S: a light tenant's later arrivals go ahead of a heavy tenant's queue, so a
snapshot of the queue alone under-predicts). That share is what VTC guarantees a backlogged
tenant; a tenant may get more when the others use less, so the prediction errs long.

A request of a less important band never counts, and an admitted request is never dropped:
only the new request is refused, so nothing admitted is displaced by a later arrival. With
no rate measured yet (an idle replica) nothing is predicted and every request is admitted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from iterserve.replica.errors import SLOUnreachableError
from iterserve.replica.request import Request, TenantShare

# A tenant of a band that had a request admitted this recently counts as active in it:
# its next request is likely on its way and goes ahead of a heavier tenant's queue.
ACTIVE_WINDOW_S = 2.0


@dataclass(frozen=True)
class DrainRate:
    """What the engine measured of its own pace: prompt tokens per wall second while work
    was pending, and the mean wall seconds between its recent prefilling steps."""

    tokens_per_s: float
    step_s: float


class ActiveTenants:
    """Per priority band, the tenants admitted within ACTIVE_WINDOW_S and their weights."""

    def __init__(self) -> None:
        self._last: dict[int, dict[str, tuple[float, float]]] = {}  # band -> name -> (t, w)

    def admitted(self, priority: int, tenant: TenantShare, now: float) -> None:
        self._last.setdefault(priority, {})[tenant.name] = (now, tenant.weight)

    def of_band(self, priority: int, now: float) -> dict[str, float]:
        """The band's recently admitted tenants' weights (forgetting the stale ones)."""
        band = self._last.get(priority, {})
        for name in [n for n, (t, _) in band.items() if now - t > ACTIVE_WINDOW_S]:
            del band[name]
        return {name: weight for name, (_, weight) in band.items()}


def predicted_ttft_s(admitted: Iterable[Request], prompt_tokens: int, priority: int,
                     tenant: TenantShare, fair: bool, drain: DrainRate,
                     band_active: dict[str, float]) -> float | None:
    """Seconds until a new request's first token reaches its client, or None with no rate
    measured. band_active: the weights of its band's recently admitted tenants."""
    if drain.tokens_per_s <= 0:
        return None
    ahead = 0.0  # tokens served before it at the whole rate
    own = float(prompt_tokens)  # tokens served at its tenant's share of the rate
    others = dict(band_active) if fair else {}
    for request in admitted:
        queued = request.num_prompt_tokens - request.num_computed_tokens
        if queued <= 0 or request.priority > priority:
            continue
        if request.priority < priority or not fair:
            ahead += queued
        elif request.tenant == tenant.name:
            own += queued
        else:
            others[request.tenant] = request.tenant_weight
    others.pop(tenant.name, None)
    share = tenant.weight / (tenant.weight + sum(others.values()))
    engine_s = (ahead + own / share) / drain.tokens_per_s
    return tenant.ttft_outside_engine_s + drain.step_s + engine_s


def check_ttft_slo(admitted: Iterable[Request], prompt_tokens: int, priority: int,
                   tenant: TenantShare, fair: bool, drain: DrainRate,
                   band_active: dict[str, float], headroom: float) -> None:
    """Raise SLOUnreachableError (a 429 with Retry-After) when the tenant has a TTFT
    objective and the request's predicted TTFT exceeds `headroom` x that objective."""
    if tenant.ttft_slo_ms is None:
        return
    predicted = predicted_ttft_s(admitted, prompt_tokens, priority, tenant, fair, drain,
                                 band_active)
    limit_s = headroom * tenant.ttft_slo_ms / 1000
    if predicted is None or predicted <= limit_s:
        return
    # Retry once the excess work ahead has drained at the measured rate.
    raise SLOUnreachableError(predicted * 1000, tenant.ttft_slo_ms, predicted - limit_s)
