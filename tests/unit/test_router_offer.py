"""IterserveRouter decides the same with a caller's `OfferDelta` (per-replica work only for
the views that changed) as without it (every view read, the candidates shuffled)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Hashable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.autoscale.router_meters import RoutedWorkMeter
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.autoscale.sim.routing_context import (
    OfferDelta,
    ReplicaView,
    RouteRequest,
    RoutingContext,
)
from iterserve.autoscale.sim.shapes import make
from tests.unit.test_router_table import PROMPT, _config, _load

NOW = 1000.0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([3, 20, RoutedWorkMeter.ARRAYS_FROM + 5]))
def test_the_same_choices_and_draws_with_and_without_the_delta(seed: int, n: int) -> None:
    rng = random.Random(seed)
    config = _config(rng)
    plain, offered = IterserveRouter(config), IterserveRouter(config)
    plain_rng, offered_rng = random.Random(seed), random.Random(seed)
    ids = [f"r{i}" for i in range(n)]
    cache = {rid: rng.choice([0, 0, 16, 48]) for rid in ids}

    def answers(prompt: Sequence[int], asked: Sequence[Hashable]) -> dict[Hashable, int]:
        return {rid: cache[rid] for rid in asked if cache[rid]}

    token: object = object()
    views = [ReplicaView(rid, _load(rng)) for rid in ids]
    live: list[tuple[str, str]] = []
    for step in range(40):
        before = list(views)
        if rng.random() < 0.1:  # another offer: other replicas, another order
            token = object()
            views = rng.sample(views, rng.randint(1, len(views)))
        for i in rng.sample(range(len(views)), rng.randrange(min(4, len(views)) + 1)):
            # a new view: new stats, or the same stats object in a new view
            load = _load(rng) if rng.random() < 0.7 else views[i].load
            views[i] = ReplicaView(views[i].replica_id, load)
        if rng.random() < 0.3:
            cache[rng.choice(ids)] = rng.choice([0, 16, 64])
        changed = [i for i, v in enumerate(views) if i >= len(before) or v is not before[i]]
        request = RouteRequest(f"q{step}", PROMPT[: rng.choice([8, 40, 80])],
                               rng.choice([16, 200]), NOW + step)
        prefix = answers if rng.random() < 0.8 else None
        ctx = RoutingContext(request, list(views), NOW + step, 16, prefix)
        want = plain.choose(ctx, plain_rng)
        got = offered.choose(dataclasses.replace(ctx, offer=OfferDelta(token, changed)),
                             offered_rng)
        assert got == want, f"step {step}"
        assert offered_rng.getstate() == plain_rng.getstate()
        if rng.random() < 0.15:  # a context without a delta, other stats: rows recomputed
            other = [ReplicaView(v.replica_id, _load(rng)) for v in views]
            foreign = RoutingContext(request, other, NOW + step, 16, prefix)
            assert offered.choose(foreign, offered_rng) == plain.choose(foreign, plain_rng)
        for router in (plain, offered):  # the same in-flight changes: rows invalidated
            router.on_routed(request, want, NOW + step)
        live.append((request.request_id, want))
        if rng.random() < 0.4:
            done = live.pop(rng.randrange(len(live)))
            for router in (plain, offered):
                router.on_completed(done[0], done[1], NOW + step)
        if rng.random() < 0.05:
            remaining = ids[1:]
            for router in (plain, offered):
                router.on_replicas_changed(remaining)


def test_ties_are_broken_by_the_shuffled_order() -> None:
    """Identical replicas: the choice is the first of the shuffled candidates."""
    idle = ReplicaLoad(0.0, 0, 0, 100, 100, 0.0, timestamp=NOW)
    views = [ReplicaView(f"r{i}", idle) for i in range(9)]
    request = RouteRequest("q", PROMPT, 16, NOW)
    ctx = RoutingContext(request, views, NOW, 16, offer=OfferDelta(object(), []))
    chosen = {IterserveRouter().choose(ctx, random.Random(seed)) for seed in range(30)}
    expected = set()
    for seed in range(30):
        shuffled = list(views)
        random.Random(seed).shuffle(shuffled)
        expected.add(shuffled[0].replica_id)
    assert chosen == expected and len(chosen) > 3


class _WithoutDelta(IterserveRouter):
    """The production router, not told what changed (the reference)."""

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        return super().choose(dataclasses.replace(ctx, offer=None), rng)


@pytest.mark.parametrize("num_replicas, max_ongoing",
                         [(6, 3), (RoutedWorkMeter.ARRAYS_FROM + 2, 512)])
def test_a_simulation_gives_byte_identical_results_with_and_without_the_delta(
        num_replicas: int, max_ongoing: int) -> None:
    """max_ongoing 3: replicas fill up and free up, so the offer changes often."""
    workload = make("chat-summarise", 3.0 * num_replicas, 2.0, seed=3)
    config = ClusterSimConfig(seed=3, num_blocks=400, max_ongoing_requests=max_ongoing)
    runs = [simulate(workload, [cls(), cls()], num_replicas, config).to_json()
            for cls in (IterserveRouter, _WithoutDelta)]
    assert runs[0] == runs[1]
