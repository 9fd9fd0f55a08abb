"""rank_replicas over hand-built loads: no Ray, no clock (time is passed in)."""

from __future__ import annotations

import pytest
from router_oracle import rank_replicas, score_replicas

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.router_policy import (
    TIER_DRAINING,
    TIER_HOT,
    TIER_OK,
    Correction,
    InFlightTracker,
    PrefixAffinityTable,
    prefix_hash,
    to_rank_groups,
)
from iterserve.autoscale.signals import ReplicaLoad

NOW = 1000.0
CFG = RouterConfig()


def load(kv=0.1, waiting=0, running=1, ts=NOW - 0.2, max_waiting=None, draining=False):
    total = 1000
    return ReplicaLoad(
        kv_usage=kv, num_waiting=waiting, num_running=running,
        num_free_blocks=int(total * (1 - kv)), num_total_blocks=total,
        step_token_rate=0.0, timestamp=ts, max_waiting_requests=max_waiting, draining=draining,
    )


def rank(loads, corrections=None, config=CFG, **kw):
    return rank_replicas(list(loads), loads, corrections or {}, config, now=NOW, **kw)


def test_fewest_waiting_first_then_lowest_kv():
    loads = {"a": load(kv=0.2, waiting=3), "b": load(kv=0.7, waiting=0), "c": load(kv=0.3)}
    assert rank(loads) == ["c", "b", "a"]


def test_over_watermark_ranked_last_even_if_idle_queue():
    loads = {"hot": load(kv=0.95, waiting=0), "busy": load(kv=0.5, waiting=4)}
    assert rank(loads) == ["busy", "hot"]


def test_full_waiting_queue_ranked_last():
    loads = {"full": load(kv=0.1, waiting=8, max_waiting=8), "b": load(kv=0.6, waiting=7)}
    assert rank(loads) == ["b", "full"]
    # the config bound wins over the replica's own bound
    cfg = RouterConfig(max_waiting_per_replica=5)
    loads = {"a": load(waiting=5), "b": load(kv=0.8, waiting=4, max_waiting=100)}
    assert rank(loads, config=cfg) == ["b", "a"]


def test_draining_is_last_of_all():
    loads = {"d": load(kv=0.0, draining=True), "hot": load(kv=0.99)}
    assert rank(loads) == ["hot", "d"]
    tiers = {s.replica_id: s.tier for s in score_replicas(list(loads), loads, {}, CFG, NOW)}
    assert tiers == {"d": TIER_DRAINING, "hot": TIER_HOT}


def test_in_flight_corrections_spread_a_burst_between_stats_updates():
    loads = {"a": load(kv=0.1), "b": load(kv=0.2)}
    tracker: InFlightTracker[str] = InFlightTracker()
    chosen = []
    for i in range(6):  # six requests arrive before any stats update
        best = rank(loads, tracker.corrections(loads))[0]
        tracker.routed(f"r{i}", best, at=NOW)
        chosen.append(best)
    assert chosen.count("a") == 3 and chosen.count("b") == 3


def test_corrections_only_count_requests_routed_after_the_stats():
    loads = {"a": load(ts=NOW - 1.0)}
    tracker: InFlightTracker[str] = InFlightTracker()
    tracker.routed("old", "a", at=NOW - 2.0)  # the stats already include it
    tracker.routed("new", "a", at=NOW - 0.5)
    assert tracker.corrections(loads) == {"a": Correction(1, 0, 0)}
    assert tracker.completed("new") == "a"
    assert tracker.completed("unknown") is None  # rejected requests complete unrouted
    assert tracker.corrections(loads) == {"a": Correction(0, 0, 0)}
    tracker.routed("big", "a", at=NOW - 2.0, prompt_tokens=500)  # seen, but still in flight
    assert tracker.corrections(loads) == {"a": Correction(0, 0, 500)}


def test_correction_pushes_replica_over_watermark():
    loads = {"a": load(kv=0.85), "b": load(kv=0.5, waiting=1)}
    assert rank(loads)[0] == "a"
    # three unseen requests x 0.02 kv -> 0.91 >= 0.90: hot
    assert rank(loads, {"a": 3})[0] == "b"


def test_missing_stats_score_as_idle_plus_corrections_stale_ones_rank_after_fresh():
    loads = {"stale": load(kv=0.05, ts=NOW - 60), "b": load(kv=0.3), "new": None}
    # a new replica (no stats) is idle; a silent one is suspect even if it looked idle
    assert rank(loads) == ["new", "b", "stale"]
    scores = {s.replica_id: s for s in score_replicas(list(loads), loads, {"new": 2}, CFG, NOW)}
    assert scores["stale"].stale and scores["stale"].tier == TIER_HOT
    assert scores["new"].eff_waiting == 2 and scores["new"].tier == TIER_OK


def test_ties_keep_candidate_order():
    loads = {"x": load(kv=0.2), "y": load(kv=0.2), "z": load(kv=0.2)}
    assert rank_replicas(["z", "x", "y"], loads, {}, CFG, now=NOW) == ["z", "x", "y"]


def test_prefix_affinity_prefers_holder_within_slack():
    loads = {"a": load(kv=0.1), "b": load(kv=0.4)}  # b within the 0.5 slack of a
    table: PrefixAffinityTable[str] = PrefixAffinityTable(10)
    key = prefix_hash(list(range(100)), 16, 4)
    table.record(key, "b")
    assert rank(loads, prompt_prefix_hash=key, affinity=table.as_mapping())[0] == "b"
    # unrelated prompt: load order
    other = prefix_hash(list(range(1, 101)), 16, 4)
    assert rank(loads, prompt_prefix_hash=other, affinity=table.as_mapping())[0] == "a"
    # disabled in config
    off = RouterConfig(prefix_affinity=False)
    assert rank(loads, config=off, prompt_prefix_hash=key, affinity=table.as_mapping())[0] == "a"


def test_prefix_affinity_yields_over_watermark_or_beyond_slack():
    table: PrefixAffinityTable[str] = PrefixAffinityTable(10)
    key = prefix_hash(list(range(64)), 16, 4)
    table.record(key, "b")
    hot = {"a": load(kv=0.1), "b": load(kv=0.95)}
    assert rank(hot, prompt_prefix_hash=key, affinity=table.as_mapping())[0] == "a"
    far = {"a": load(kv=0.1), "b": load(kv=0.3, waiting=5)}
    assert rank(far, prompt_prefix_hash=key, affinity=table.as_mapping())[0] == "a"


def test_prefix_hash_uses_leading_full_blocks_only():
    base = list(range(200))
    assert prefix_hash(base[:15], 16, 4) is None
    assert prefix_hash(base, 16, 4) == prefix_hash(base[:64] + [7] * 50, 16, 4)
    assert prefix_hash(base[:32], 16, 4) != prefix_hash(base[:48], 16, 4)
    assert prefix_hash(base, 16, 4) != prefix_hash([1] + base[1:], 16, 4)


def test_affinity_table_is_bounded_lru_and_forgets_replicas():
    table: PrefixAffinityTable[str] = PrefixAffinityTable(2)
    table.record(1, "a")
    table.record(2, "b")
    table.record(1, "a")
    table.record(3, "c")  # evicts 2, the least recently used
    assert dict(table.as_mapping()) == {1: "a", 3: "c"}
    table.forget_replica("a")
    assert dict(table.as_mapping()) == {3: "c"}
    table.record(None, "x")
    assert len(table) == 1
    with pytest.raises(ValueError):
        PrefixAffinityTable(0)


def test_rank_groups_are_singletons_in_order():
    assert to_rank_groups(["b", "a"]) == [["b"], ["a"]]


def test_router_config_validation():
    with pytest.raises(ValueError):
        RouterConfig(kv_high_watermark=1.5)
    with pytest.raises(ValueError):
        RouterConfig(routing_stats_period_s=5)  # the brief: 1 s or less
    with pytest.raises(ValueError):
        RouterConfig(bogus=1)
    assert RouterConfig(**RouterConfig().model_dump()) == RouterConfig()


def test_size_aware_correction_uses_prompt_tokens_over_kv_capacity():
    # 1000 blocks x 16 tokens = 16000 tokens; an unseen 4000-token prompt is +0.25 kv
    loads = {"a": load(kv=0.3), "b": load(kv=0.45)}
    assert rank(loads, {"a": Correction(0, 0)})[0] == "a"
    assert rank(loads, {"a": Correction(1, 4000), "b": Correction(1, 100)})[0] == "b"
    scores = score_replicas(["a"], loads, {"a": Correction(1, 4000)}, CFG, NOW)
    assert scores[0].eff_kv == pytest.approx(0.55)
    # 0.3 + 0.65 -> over the watermark
    scores = score_replicas(["a"], loads, {"a": Correction(1, 10400)}, CFG, NOW)
    assert scores[0].tier == TIER_HOT


def test_a_big_request_avoids_replicas_it_would_push_over_the_watermark():
    # 16000 KV tokens per replica; a 6400-token prompt is 0.4 of a replica
    loads = {"a": load(kv=0.55, waiting=0), "b": load(kv=0.2, waiting=1)}
    assert rank(loads)[0] == "a"  # fewest waiting first
    assert rank(loads, request_tokens=100)[0] == "a"
    assert rank_replicas(list(loads), loads, {}, CFG, now=NOW, request_tokens=6400)[0] == "b"


# --------------------------------------------------- the Ray adapter, without Ray processes
class _FakeReplica:
    def __init__(self, rid, stats):
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(rid, DeploymentID("LLMReplica", "app"))
        self.routing_stats = stats
        self.max_ongoing_requests = 64
        self.node_id, self.availability_zone, self.multiplexed_model_ids = "n", None, set()

    async def get_queue_len(self, *, deadline_s):
        return 0


def _router(**kwargs):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from iterserve.autoscale.router import KVAwareRouter

    router = KVAwareRouter(deployment_id=DeploymentID("LLMReplica", "app"),
                           handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**RouterConfig(**kwargs).model_dump())
    return router


def _pending(args, kwargs=None, rid="x"):
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    meta = RequestMetadata(request_id=rid, internal_request_id=rid)
    return PendingRequest(args=list(args), kwargs=kwargs or {}, metadata=meta,
                          future=None)


def test_adapter_ranks_singletons_and_sets_backoff():
    import asyncio
    import time as _time

    # Build the router first: on a loaded machine its construction can outlast
    # stats_stale_after_s, which would make stats stamped before it look stale.
    router = _router(prefix_affinity=False)
    now = _time.time()
    full = _FakeReplica("full", load(kv=0.97, ts=now).to_dict())
    busy = _FakeReplica("busy", load(kv=0.3, waiting=2, ts=now).to_dict())
    idle = _FakeReplica("idle", load(kv=0.1, ts=now).to_dict())
    pending = _pending([list(range(50))])
    ranks = asyncio.run(router.choose_replicas([full, busy, idle], pending))
    assert [[r.replica_id.unique_id for r in g] for g in ranks] == [["idle"], ["busy"], ["full"]]
    assert pending.routing_context.should_backoff


def test_adapter_tracks_in_flight_and_affinity():
    import asyncio
    import time as _time

    # first: see test_adapter_ranks_singletons_and_sets_backoff. The routed-work meter is
    # off: this test is about affinity and in-flight counts (the meter has its own test).
    router = _router(routed_work_weight=0.0)
    now = _time.time()
    a = _FakeReplica("a", load(kv=0.1, ts=now - 0.5).to_dict())
    b = _FakeReplica("b", load(kv=0.1, ts=now - 0.5).to_dict())
    prompt = list(range(80))
    first = asyncio.run(router.choose_replicas([a, b], _pending([prompt], rid="1")))[0][0]
    router.on_request_routed(_pending([prompt], rid="1"), first.replica_id, None)
    other = b if first is a else a
    # before any stats show it, the unseen request counts as one waiting: more than the
    # affinity slack, so even a shared prefix goes to the other replica (bursts spread)
    second = asyncio.run(router.choose_replicas([a, b], _pending([prompt], rid="2")))[0][0]
    assert second.replica_id == other.replica_id
    # once stats show it running (no longer unseen), affinity wins within the slack
    first.routing_stats = load(kv=0.3, running=1, ts=_time.time() + 1).to_dict()
    other.routing_stats = load(kv=0.1, running=0, ts=_time.time() + 1).to_dict()
    third = asyncio.run(router.choose_replicas([a, b], _pending([prompt], rid="3")))[0][0]
    assert third.replica_id == first.replica_id
    fresh = asyncio.run(router.choose_replicas([a, b], _pending([[9] * 80], rid="4")))[0][0]
    assert fresh.replica_id == other.replica_id  # no affinity: load order
    router.on_request_completed(first.replica_id, "1")
    router.on_request_completed(first.replica_id, "never-routed")  # rejected: ignored
    assert len(router._core.in_flight) == 0


def test_extract_prompt_token_ids():
    from iterserve.autoscale.router import extract_prompt_token_ids

    assert extract_prompt_token_ids([[1, 2, 3], "params"], {}) == [1, 2, 3]
    assert extract_prompt_token_ids([], {"prompt_token_ids": (4, 5)}) == [4, 5]
    assert extract_prompt_token_ids([{"prompt_token_ids": [6]}], {}) == [6]

    class Req:
        prompt_token_ids = [7, 8]

    assert extract_prompt_token_ids([Req()], {}) == [7, 8]
    assert extract_prompt_token_ids(["a prompt"], {}) is None
    assert extract_prompt_token_ids([["a", "b"]], {}) is None
    assert extract_prompt_token_ids([], {}) is None


def test_extract_max_tokens():
    from iterserve.autoscale.router import extract_max_tokens
    from iterserve.replica.sampling_params import SamplingParams

    assert extract_max_tokens([[1, 2], SamplingParams(max_tokens=77), "rid"], {}) == 77
    assert extract_max_tokens([[1]], {"params": SamplingParams(max_tokens=5)}) == 5
    assert extract_max_tokens([{"prompt_token_ids": [1], "max_tokens": 9}], {}) == 9
    assert extract_max_tokens([[1, 2]], {}) == 0


def test_committed_kv_counts_growth_the_stats_do_not_show_yet():
    # both at kv 0.3 now, but this router has 12000 tokens (prompt + max_tokens) in flight
    # on "a": 0.75 of its 16000-token cache will be needed
    loads = {"a": load(kv=0.3), "b": load(kv=0.35)}
    assert rank(loads)[0] == "a"
    assert rank(loads, {"a": Correction(0, 0, 12000)})[0] == "b"
    off = RouterConfig(use_committed_kv=False)
    assert rank(loads, {"a": Correction(0, 0, 12000)}, config=off)[0] == "a"
    # and a big request would push "a" over the watermark
    s = score_replicas(["a"], loads, {"a": Correction(0, 0, 12000)}, CFG, NOW, 3000)[0]
    assert s.eff_kv == pytest.approx(0.75) and s.tier == TIER_HOT


def test_prefill_work_counts_the_size_of_unseen_prompts():
    loads = {"a": load(), "b": load()}
    # one unseen request each, but a's is a 6000-token prompt and b's 100 tokens
    corr = {"a": Correction(1, 6100, 6100, 6000), "b": Correction(1, 200, 200, 100)}
    assert rank(loads, corr)[0] == "b"
    on = {s.replica_id: s.score for s in score_replicas(["a", "b"], loads, corr, CFG, NOW)}
    off_cfg = RouterConfig(score_prefill_work=False)
    off = {s.replica_id: s.score for s in score_replicas(["a", "b"], loads, corr, off_cfg,
                                                         NOW)}
    gap = (on["a"] - on["b"]) - (off["a"] - off["b"])
    assert abs(gap - (6000 - 100) / CFG.prefill_tokens_per_waiting) < 1e-9


def test_replica_cache_answers_replace_affinity():
    loads = {"a": load(kv=0.2), "b": load(kv=0.1)}
    # b holds 6000 of the 7000-token prompt: 6000 / 512 waiting-equivalents saved
    cached = {"a": 0, "b": 6000}
    assert rank_replicas(["a", "b"], loads, {}, CFG, prompt_tokens=7000,
                         cached_tokens=cached)[0] == "b"
    # the affinity table (a) is ignored when the replicas' answers are known
    assert rank_replicas(["a", "b"], {"a": load(kv=0.1), "b": load(kv=0.1)}, {}, CFG,
                         prompt_prefix_hash=7, affinity={7: "a"}, prompt_tokens=7000,
                         cached_tokens={"a": 0, "b": 6000})[0] == "b"
    # but load still wins over a cache hit when the cached replica is far behind
    busy = {"a": load(kv=0.1), "b": load(kv=0.3, waiting=20)}
    assert rank_replicas(["a", "b"], busy, {}, CFG, prompt_tokens=7000,
                         cached_tokens=cached)[0] == "a"


def test_routed_work_meter_decays_and_balances_what_stats_cannot_show():
    from iterserve.autoscale.router_meters import RoutedWorkMeter

    meter: RoutedWorkMeter[str] = RoutedWorkMeter(half_life_s=5.0)
    meter.add("a", 4096, now=0.0)
    assert meter.snapshot(5.0)["a"] == 2048.0
    meter.add("a", 1000, now=5.0)
    assert meter.snapshot(5.0)["a"] == 3048.0
    loads = {"a": load(), "b": load()}
    work = meter.snapshot(5.0)
    assert rank_replicas(["a", "b"], loads, {}, CFG, routed_work=work)[0] == "b"
    # a replica that caches most of the prompt keeps it despite the work sent there
    assert rank_replicas(["a", "b"], loads, {}, CFG, routed_work=work, prompt_tokens=7000,
                         cached_tokens={"a": 6000, "b": 0})[0] == "a"
    meter.forget_replica("a")
    assert meter.snapshot(5.0) == {}
