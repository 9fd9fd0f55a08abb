"""Seeded multi-tenant workloads for fair sharing: a noisy neighbour and backlogged tenants.

Every tenant's requests have the `steady` shape's mix (shapes.py: Poisson arrivals, a
prompt of 64-512 or 512-2048 tokens, 32-384 output tokens, no shared prefix), so a rate
in units of the steady shape's probed capacity means the same load here. Each tenant draws
from its own stream, so adding a tenant or changing one's rate leaves the others' requests
as they were (a baseline and a noisy run share tenant B's requests exactly).

    noisy_neighbour   tenant "a" at `a_multiple` times tenant "b"'s rate
    backlogged        one tenant per weight ("w1", "w2", "w4" for 1:2:4; "t0".. for equal
                      weights), each at its own rate
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from iterserve.autoscale.sim.arrivals import poisson_times
from iterserve.autoscale.sim.prompts import SyntheticPrompt, unique_start
from iterserve.autoscale.sim.shapes import VOCAB
from iterserve.autoscale.sim.tenancy import SimTenant
from iterserve.autoscale.sim.workload import WorkloadRequest


def tenant_requests(tenant: str, rate: float, duration_s: float, seed: int,
                    first_index: int) -> list[WorkloadRequest]:
    """One tenant's Poisson requests of the steady shape, from its own seeded stream;
    first_index: where its requests' unique prompt tokens start (distinct per tenant)."""
    rng = random.Random(f"tenant/{tenant}/{seed}")
    out = []
    for i, t in enumerate(poisson_times(rng, rate, duration_s)):
        length = rng.choice([rng.randint(64, 512), rng.randint(512, 2048)])
        prompt = SyntheticPrompt((), unique_start(first_index + i), length, True)
        out.append(WorkloadRequest(f"{tenant}-{i}", t, prompt, rng.randint(32, 384),
                                   output_token_id=rng.randrange(*VOCAB), tenant=tenant))
    return out


def merged(*tenants: list[WorkloadRequest]) -> list[WorkloadRequest]:
    return sorted((r for requests in tenants for r in requests), key=lambda r: r.arrival_time)


# Far apart, so two tenants' unique prompt tokens never meet (a tenant sends < 1M requests).
_TENANT_STRIDE = 1_000_000


def noisy_neighbour(b_rate: float, a_rate: float, duration_s: float, seed: int
                    ) -> list[WorkloadRequest]:
    """Tenant "b" at b_rate and tenant "a" at a_rate requests/s (the noisy run: a_rate =
    10 x b_rate; the baseline: a at its fair share)."""
    return merged(tenant_requests("b", b_rate, duration_s, seed, 0),
                  tenant_requests("a", a_rate, duration_s, seed, _TENANT_STRIDE))


def backlogged_tenants(weights: Sequence[float]) -> tuple[SimTenant, ...]:
    """One tenant per weight: "w1", "w2", "w4" for 1:2:4; "t0", "t1", .. for equal weights."""
    if len(set(weights)) == len(weights):
        return tuple(SimTenant(f"w{w:g}", w) for w in weights)
    return tuple(SimTenant(f"t{i}", w) for i, w in enumerate(weights))


def backlogged(tenants: Sequence[SimTenant], rates: Sequence[float], duration_s: float,
               seed: int) -> list[WorkloadRequest]:
    """Each tenant at its rate, requests/s (each above its share of the capacity: all
    backlogged)."""
    return merged(*(tenant_requests(t.name, rate, duration_s, seed, i * _TENANT_STRIDE)
                    for i, (t, rate) in enumerate(zip(tenants, rates, strict=True))))
