"""Every routing baseline on hand-made situations (no simulator)."""

from __future__ import annotations

import random

from iterserve.autoscale.signals import ReplicaLoad
from iterserve.autoscale.sim.baseline_cache_routers import (
    DynamoRouter,
    LlmdRouter,
    RayPrefixAffinityRouter,
    SglangRouter,
)
from iterserve.autoscale.sim.baseline_routers import (
    LeastKVRouter,
    LlmdWeights,
    PowerOfTwoRouter,
    RandomRouter,
    RoundRobinRouter,
    dynamo_costs,
    llmd_scores,
)
from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.autoscale.sim.prefix_history import PrefixHistory, block_chain
from iterserve.autoscale.sim.routing_context import ReplicaView, RouteRequest, RoutingContext

BS = 16


def load(kv: float = 0.0, waiting: int = 0, running: int = 0, ts: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(kv_usage=kv, num_waiting=waiting, num_running=running,
                       num_free_blocks=int(1000 * (1 - kv)), num_total_blocks=1000,
                       step_token_rate=0.0, timestamp=ts)


def ctx(views: list[ReplicaView], prompt: list[int], rid: str = "r") -> RoutingContext:
    return RoutingContext(RouteRequest(rid, prompt, 16, 0.0), views, now=0.0, block_size=BS)


def views(**loads: ReplicaLoad | None) -> list[ReplicaView]:
    return [ReplicaView(name, ld) for name, ld in loads.items()]


def route(policy, c: RoutingContext, rng: random.Random | None = None):  # noqa: ANN001, ANN201
    rid = policy.choose(c, rng or random.Random(0))
    policy.on_routed(c.request, rid, 0.0)
    return rid


def test_block_chain_and_history_match_whole_leading_blocks():
    a = list(range(64))
    b = a[:32] + [999] * 32
    ca, cb = block_chain(a, BS), block_chain(b, BS)
    assert len(ca) == 4 and ca[:2] == cb[:2] and ca[2] != cb[2]
    assert block_chain(list(range(15)), BS) == []
    h = PrefixHistory(capacity_blocks=4)
    h.record("x", ca)
    assert h.matched_blocks("x", cb) == 2 and h.matched_blocks("y", ca) == 0
    h.record("x", cb)  # shared blocks refreshed; the 2 new ones evict a's blocks 2 and 3
    assert h.size_blocks("x") == 4 and h.matched_blocks("x", ca) == 2
    assert h.matched_blocks("x", cb) == 4
    h.keep_only(["y"])
    assert h.size_blocks("x") == 0


def test_random_covers_all_and_round_robin_cycles():
    vs = views(a=None, b=None, c=None)
    seen = {RandomRouter().choose(ctx(vs, [1]), random.Random(s)) for s in range(50)}
    assert seen == {"a", "b", "c"}
    rr = RoundRobinRouter()
    assert [route(rr, ctx(vs, [1])) for _ in range(4)] == ["a", "b", "c", "a"]


def test_power_of_two_takes_the_shorter_of_two_sampled_queues():
    vs = [ReplicaView("busy", None, ongoing=5), ReplicaView("idle", None, ongoing=0)]
    for seed in range(20):
        assert PowerOfTwoRouter().choose(ctx(vs, [1]), random.Random(seed)) == "idle"
    # with three, the longest queue can never win (it loses to either other sample)
    vs3 = vs + [ReplicaView("mid", None, ongoing=2)]
    picks = {PowerOfTwoRouter().choose(ctx(vs3, [1]), random.Random(s)) for s in range(50)}
    assert picks == {"idle", "mid"}


def test_least_kv_picks_lowest_usage_and_new_replicas_count_empty():
    vs = views(a=load(kv=0.5), b=load(kv=0.2), c=load(kv=0.9))
    assert LeastKVRouter().choose(ctx(vs, [1]), random.Random(0)) == "b"
    vs = views(a=load(kv=0.1), new=None)
    assert LeastKVRouter().choose(ctx(vs, [1]), random.Random(0)) == "new"


def test_llmd_scores_follow_the_weighted_scorers():
    vs = views(a=load(kv=0.5, waiting=4), b=load(kv=0.0, waiting=0))
    s = llmd_scores(vs, [1.0, 0.0], LlmdWeights())
    # a: queue 0, kv 0.5*2, prefix 3 = 4; b: queue 2, kv 2, prefix 0 = 4
    assert s == [4.0, 4.0]
    assert llmd_scores(vs, [0.0, 0.0], LlmdWeights())[1] > llmd_scores(vs, [0.0, 0.0],
                                                                        LlmdWeights())[0]


def test_llmd_router_follows_history_unless_load_outweighs_it():
    prompt = list(range(128))
    r = LlmdRouter()
    vs = views(a=load(), b=load())
    first = route(r, ctx(vs, prompt, "1"))
    assert route(r, ctx(vs, prompt, "2")) == first  # prefix 3 beats nothing
    other = "b" if first == "a" else "a"
    loaded = views(**{first: load(kv=1.0, waiting=9), other: load()})
    assert r.choose(ctx(loaded, prompt, "3"), random.Random(0)) == other  # 3 < 2 + 2


def test_llmd_precise_reads_the_replicas_own_cache():
    prompt = list(range(128))
    vs = [ReplicaView("a", load(), cached_prefix_tokens=lambda p: 0),
          ReplicaView("b", load(), cached_prefix_tokens=lambda p: len(p))]
    assert LlmdRouter(precise=True).choose(ctx(vs, prompt), random.Random(0)) == "b"


def test_dynamo_cost_trades_prefill_against_decode_blocks():
    # 160-token prompt: 'a' holds 128 of it but has 20 active blocks; 'b' has nothing, 5
    costs = dynamo_costs(160, [128, 0], [0, 0], [20, 5], BS, 1.0)
    assert costs == [2 + 20 + 10, 10 + 5 + 10]
    assert dynamo_costs(160, [128, 0], [0, 0], [20, 5], BS, 3.0)[0] < 3 * 10 + 5 + 10


def test_dynamo_router_tracks_its_active_prefill_and_decode():
    prompt = list(range(320))  # 20 blocks
    r = DynamoRouter()
    vs = [ReplicaView("a", None, cached_prefix_tokens=lambda p: 0),
          ReplicaView("b", None, cached_prefix_tokens=lambda p: 0)]
    first = route(r, ctx(vs, prompt, "1"))
    # identical empty caches: the replica with the request in flight costs more
    assert route(r, ctx(vs, prompt, "2")) != first
    r.on_completed("1", first, 1.0)
    r.on_completed("2", "x", 1.0)
    cached = [ReplicaView("a", None, cached_prefix_tokens=lambda p: len(p)),
              ReplicaView("b", None, cached_prefix_tokens=lambda p: 0)]
    assert r.choose(ctx(cached, prompt, "3"), random.Random(0)) == "a"


def test_ray_prefix_affinity_matches_then_smallest_tree():
    r = RayPrefixAffinityRouter()
    vs = views(a=None, b=None)
    r.on_replicas_changed(["a", "b"])
    p1 = list(range(200))
    first = route(r, ctx(vs, p1, "1"))
    assert route(r, ctx(vs, p1[:100] + [7] * 100, "2")) == first  # 6 of 12 blocks >= 10 %
    # no match: the smallest tree (the other replica)
    other = "b" if first == "a" else "a"
    assert route(r, ctx(vs, [5] * 200, "3")) == other
    # imbalanced beyond a threshold: power of two on queue length instead
    guarded = RayPrefixAffinityRouter(imbalanced_threshold=2)
    guarded.history = r.history
    qs = [ReplicaView(first, None, ongoing=10), ReplicaView(other, None, ongoing=0)]
    assert guarded.choose(ctx(qs, p1, "4"), random.Random(0)) == other


def test_sglang_balances_when_imbalanced_else_caches():
    r = SglangRouter()
    vs = views(a=None, b=None)
    prompt = list(range(160))
    first = route(r, ctx(vs, prompt, "0"))
    assert route(r, ctx(vs, prompt, "1")) == first  # match 100 % > 0.3
    other = "b" if first == "a" else "a"
    for i in range(70):  # 72 in flight on `first`, 0 on the other: 72 - 0 > 64, 72 > 1.5*0
        r.on_routed(RouteRequest(f"x{i}", [1], 1, 0.0), first, 0.0)
    assert r.choose(ctx(vs, prompt, "2"), random.Random(0)) == other
    for i in range(70):
        r.on_completed(f"x{i}", first, 0.0)
    assert r.choose(ctx(vs, [3] * 160, "3"), random.Random(0)) == other  # smallest tree


def test_iterserve_router_policy_matches_the_core_ranking():
    r = IterserveRouter()
    vs = views(hot=load(kv=0.95), busy=load(kv=0.3, waiting=2), idle=load(kv=0.1))
    assert r.choose(ctx(vs, list(range(50))), random.Random(0)) == "idle"
    route(r, ctx(vs, list(range(50)), "1"))
    assert len(r.core.in_flight) == 1
    r.on_completed("1", "idle", 1.0)
    assert len(r.core.in_flight) == 0
