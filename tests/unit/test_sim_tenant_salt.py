"""The simulator's tenant salting (autoscale/sim/tenant_salt.py): a tenant's prompts live in
its cache namespace in the simulated replicas' block managers and in the cluster's prefix
index alike, so a second tenant's identical prompt finds nothing cached; and salting by
tenant leaves the multi-tenant shape's cache hits as they were (its tenants share no
context), which is why its tournament cells do not move (router_tournament/README.md)."""

from __future__ import annotations

import pytest

from iterserve.autoscale.sim.baseline_routers import RoundRobinRouter
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.prefix import ClusterPrefixCache, PromptBlockKeys
from iterserve.autoscale.sim.prompts import SyntheticPrompt, unique_start
from iterserve.autoscale.sim.shapes import make
from iterserve.autoscale.sim.tenant_salt import salted_by_tenant
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.replica.block_keys import cache_namespace
from iterserve.replica.block_manager import BlockManager
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams

HEAD = tuple(range(1 << 29, (1 << 29) + 2000))  # a 2,000-token shared head


def two_tenants(n: int) -> list[WorkloadRequest]:
    """Tenants a and b alternate, every prompt the shared HEAD and 200 own tokens."""
    return [WorkloadRequest(f"r{i}", 0.5 * i, SyntheticPrompt(HEAD, unique_start(i), 200, True),
                            16, tenant="ab"[i % 2]) for i in range(n)]


def hit_rate(requests: list[WorkloadRequest], router: type = RoundRobinRouter) -> float:
    return simulate(requests, [router()], 1, ClusterSimConfig()).prefix_hit_rate


def test_salting_splits_a_shared_head_by_tenant_and_a_grant_joins_it_again() -> None:
    plain = hit_rate(two_tenants(20))
    salted = hit_rate(salted_by_tenant(two_tenants(20)))
    granted = hit_rate(salted_by_tenant(two_tenants(20), shared={"a": "g", "b": "g"}))
    # Plain: only the first request computes the head. Salted: each tenant's first does.
    assert salted < plain
    assert granted == pytest.approx(plain)
    salted_ns = {r.prompt_token_ids.cache_namespace for r in salted_by_tenant(two_tenants(4))}
    assert len(salted_ns) == 2 and b"" not in salted_ns


def test_the_prefix_index_keys_a_prompt_as_the_block_manager_does_in_its_namespace() -> None:
    """The routers' view of the caches (`PromptBlockKeys`, `ClusterPrefixCache`) keys a
    salted prompt's blocks as the engine's block manager stored them: found in its own
    namespace, in no other."""
    manager = BlockManager(256, 16, enable_prefix_caching=True)
    salt_a, salt_b = cache_namespace(salt="a"), cache_namespace(salt="b")
    prompt = SyntheticPrompt(HEAD, unique_start(0), 200, cache_namespace=salt_a)
    request = Request("r0", list(prompt), SamplingParams(max_tokens=1), 0.0,
                      cache_namespace=salt_a)
    manager.allocate(request, len(prompt), manager.find_cached_prefix(request))
    request.num_computed_tokens = len(prompt)
    manager.mark_computed(request)
    manager.free(request)
    full = (len(prompt) - 1) // 16
    keys = PromptBlockKeys(16)
    assert keys.num_cached_blocks(prompt, manager.cached_blocks) == full
    for other in (prompt.in_namespace(salt_b), prompt.in_namespace(b"")):
        assert keys.num_cached_blocks(other, manager.cached_blocks) == 0
    index = ClusterPrefixCache(PromptBlockKeys(16))
    index.add_replica("r", manager.cached_blocks)
    index.routed("r", prompt, 1, 1)
    assert index(prompt, ["r"]) == {"r": full * 16}
    assert index(prompt.in_namespace(salt_b), ["r"]) == {}


def test_salting_the_multi_tenant_shape_changes_no_hit() -> None:
    requests = make("multi-tenant", 6.0, 20.0, seed=0)
    assert all(r.tenant is not None for r in requests)
    assert hit_rate(requests) == hit_rate(salted_by_tenant(requests))


def test_only_synthetic_prompts_are_salted() -> None:
    with pytest.raises(ValueError, match="synthetic"):
        salted_by_tenant([WorkloadRequest("x", 0.0, [1, 2, 3], 4, tenant="a")])
    untouched = WorkloadRequest("y", 0.0, [1, 2, 3], 4)
    assert salted_by_tenant([untouched]) == [untouched]


def test_the_affinity_key_is_the_prompts_in_its_namespace() -> None:
    """The router core's prefix-affinity key (the Ray adapter's and the simulator's): an
    equal prompt in another namespace gets another key, the shared namespace the old one."""
    from iterserve.autoscale.config import RouterConfig
    from iterserve.autoscale.router_state import KVRouterCore

    core: KVRouterCore[str] = KVRouterCore(RouterConfig())
    prompt = list(HEAD[:100])
    plain, _ = core.request_key(prompt, 8)
    salted_a, _ = core.request_key(prompt, 8, cache_namespace(salt="a"))
    salted_b, _ = core.request_key(prompt, 8, cache_namespace(salt="b"))
    assert plain is not None and len({plain, salted_a, salted_b}) == 3
    assert core.request_key(prompt, 8, b"") == (plain, 108)
