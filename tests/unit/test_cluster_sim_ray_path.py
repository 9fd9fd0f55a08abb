"""The simulator's model of the Ray path's latency outside the replicas (issue 12)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from iterserve.autoscale.sim.baseline_cache_routers import RayPrefixAffinityRouter
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.prefix_history import block_chain
from iterserve.autoscale.sim.routing_context import ReplicaView, RouteRequest, RoutingContext
from iterserve.autoscale.sim.workload import WorkloadRequest


def _workload(n: int = 200, seed: int = 0) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    prefix = tuple(rng.randrange(10, 4000) for _ in range(64))
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(20.0)
        own = tuple(rng.randrange(10, 4000) for _ in range(rng.randint(20, 400)))
        out.append(WorkloadRequest(f"r{i}", t, prefix + own if i % 2 else own, rng.randint(4, 80)))
    return out


BASE = ClusterSimConfig(num_blocks=400, max_num_seqs=32, max_num_batched_tokens=512,
                        max_model_len=2048)


def test_ray_path_latency_shifts_every_request_and_changes_nothing_else() -> None:
    workload = _workload()
    plain = simulate(workload, [RayPrefixAffinityRouter()], 3, BASE)
    ray = simulate(workload, [RayPrefixAffinityRouter()], 3, dataclasses.replace(
        BASE, dispatch_latency_s=0.012, stream_latency_s=0.003))
    assert [r.replica for r in ray.records] == [r.replica for r in plain.records]
    assert ray.itl_counts == plain.itl_counts and ray.num_steps == plain.num_steps
    for a, b in zip(plain.records, ray.records, strict=True):
        assert b.ttft == pytest.approx(a.ttft + 0.015)
        assert b.latency == pytest.approx(a.latency + 0.015)


def test_negative_ray_path_latency_is_refused() -> None:
    with pytest.raises(ValueError, match="dispatch_latency_s"):
        ClusterSimConfig(dispatch_latency_s=-0.001)


def test_history_router_records_a_request_routed_after_another_was_chosen() -> None:
    """Ray routes concurrent requests concurrently: choose(A), choose(B), routed(A) must
    still record A's prompt for its replica (the Ray-path adapter relies on it)."""
    router = RayPrefixAffinityRouter()
    views = [ReplicaView("x", None), ReplicaView("y", None)]
    a = RouteRequest("a", list(range(100, 164)), 8, 0.0)
    b = RouteRequest("b", list(range(500, 564)), 8, 0.0)
    rng = random.Random(0)
    for request in (a, b):
        router.choose(RoutingContext(request, views, 0.0, 16), rng)
    router.on_routed(a, "x", 0.0)
    assert router.history.matched_blocks("x", block_chain(a.prompt_token_ids, 16)) == 4
    assert router.history.size_blocks("y") == 0
