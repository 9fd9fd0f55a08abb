"""SLO-aware admission: refuse at once a request predicted to miss its tenant's TTFT objective.

The prediction is the prefill work ahead of the new request divided by the replica's measured
drain rate: prompt tokens per second of wall time while work was pending
(`EngineStatsReporting.prefill_drain_rate`). Not the prefill_token_rate routers read (per
second of step time): that leaves out the engine loop's time between steps and the
decode-only steps while prompts wait, which a queued request waits through too. Left out
(loadtests/studies/fair_share measures the cost): the time outside the engine (ingress,
handle, streaming), the step that computes its own prompt, and under the fair policy the
lighter tenants' later arrivals, which go ahead of it.

The work ahead is the uncomputed prompt tokens of the admitted requests (running and
waiting) that run before it, plus its own prompt:

* every request of a more important band (lower priority value), and of its own band
  under the fcfs and priority policies (arrival order: all of them came first);
* under the fair policy, its band is shared as VTC shares it, which serves backlogged
  tenants in proportion to their weights: while its own tenant's queue Q_own and its prompt
  drain, another tenant t of the band is served at most Q_t, and at most
  (Q_own + prompt) x w_t / w_own (processor sharing, the fluid limit of VTC), so a light
  tenant's request is not refused for a heavy tenant's backlog.

A request of a less important band never counts, and an admitted request is never dropped:
only the new request is refused, so nothing admitted is displaced by a later arrival. With
no rate measured yet (an idle replica) nothing is predicted and every request is admitted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from iterserve.replica.errors import SLOUnreachableError
from iterserve.replica.request import Request, TenantShare


def predicted_ttft_s(admitted: Iterable[Request], prompt_tokens: int, priority: int,
                     tenant: TenantShare, fair: bool, prefill_token_rate: float) -> float | None:
    """Seconds until a new request's first token, or None with no rate measured."""
    if prefill_token_rate <= 0:
        return None
    ahead = 0.0
    band_queued: dict[str, float] = defaultdict(float)  # its band's queued tokens by tenant
    band_weight: dict[str, float] = {}
    for request in admitted:
        queued = request.num_prompt_tokens - request.num_computed_tokens
        if queued <= 0 or request.priority > priority:
            continue
        if request.priority < priority or not fair:
            ahead += queued
            continue
        band_queued[request.tenant] += queued
        band_weight[request.tenant] = request.tenant_weight
    own = band_queued.pop(tenant.name, 0.0) + prompt_tokens
    ahead += own
    for name, queued in band_queued.items():
        ahead += min(queued, own * band_weight[name] / tenant.weight)
    return ahead / prefill_token_rate


def check_ttft_slo(admitted: Iterable[Request], prompt_tokens: int, priority: int,
                   tenant: TenantShare, fair: bool, prefill_token_rate: float) -> None:
    """Raise SLOUnreachableError (a 429 with Retry-After) when the tenant has a TTFT
    objective and the request is predicted to miss it."""
    if tenant.ttft_slo_ms is None:
        return
    predicted = predicted_ttft_s(admitted, prompt_tokens, priority, tenant, fair,
                                 prefill_token_rate)
    if predicted is None or predicted * 1000 <= tenant.ttft_slo_ms:
        return
    # Retry once the excess work ahead has drained at the measured rate.
    raise SLOUnreachableError(predicted * 1000, tenant.ttft_slo_ms,
                              predicted - tenant.ttft_slo_ms / 1000)
