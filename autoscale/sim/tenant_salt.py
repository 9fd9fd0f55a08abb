"""A workload as a deployment with tenant cache isolation serves it: each tenant's prompts
in its own prefix-cache namespace (`cache_namespace(salt=<tenant>)`, what the ingress gives
a tenant's requests by default: deploy/tenants.py), or a group's where a grant shares one.

The namespace rides on the prompt (`SyntheticPrompt.cache_namespace`): the simulated
replicas' block managers key the first block in it, as the engine does, and so does the
cluster's prefix index that answers "how much of this prompt does each replica cache". The
baselines' own router-side prefix trees do not see it (as those routers do not see a salt
in production): they may send a tenant where another tenant's equal prompt went, and miss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from iterserve.autoscale.sim.prompts import SyntheticPrompt
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.replica.block_keys import cache_namespace


def salted_by_tenant(requests: Sequence[WorkloadRequest],
                     shared: Mapping[str, str] | None = None) -> list[WorkloadRequest]:
    """The requests with each tenant's prompts in its namespace; `shared` maps a tenant to
    the group whose namespace it uses instead (its cache_share grant). Requests without a
    tenant stay in the shared namespace. ValueError for a tenant's prompt that is not a
    SyntheticPrompt (the simulator's generated multi-tenant prompts are)."""
    shared = shared or {}
    out = []
    for request in requests:
        if request.tenant is None:
            out.append(request)
            continue
        prompt = request.prompt_token_ids
        if not isinstance(prompt, SyntheticPrompt):
            raise ValueError(f"{request.request_id}: only synthetic prompts can be salted")
        salt = shared.get(request.tenant, request.tenant)
        out.append(dataclasses.replace(
            request, prompt_token_ids=prompt.in_namespace(cache_namespace(salt=salt))))
    return out
