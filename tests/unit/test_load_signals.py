"""ReplicaLoad: from EngineStats, to/from the routing-stats dict, autoscaling metrics."""

from __future__ import annotations

import json
import pickle

import pytest

from iterserve.autoscale.signals import (
    AUTOSCALING_METRICS,
    ROUTING_STATS_PERIOD_S,
    ReplicaLoad,
    pack_hashes,
    unpack_hashes,
)
from iterserve.replica.stats import EngineStats


def stats(**kw):
    base = dict(
        timestamp=123.5, num_running=3, num_waiting=2, num_total_blocks=100,
        num_free_blocks=40, kv_usage=0.6, num_preemptions=1, num_out_of_blocks=0,
        last_step_tokens=12, step_token_rate=345.0, max_waiting_requests=16,
    )
    base.update(kw)
    return EngineStats(**base)


def test_from_engine_stats_round_trips_through_json():
    load = ReplicaLoad.from_engine_stats(stats())
    assert load.kv_usage == 0.6 and load.num_waiting == 2 and load.num_running == 3
    assert load.num_free_blocks == 40 and load.num_total_blocks == 100
    assert load.max_waiting_requests == 16 and load.timestamp == 123.5
    wire = json.loads(json.dumps(load.to_dict()))
    assert ReplicaLoad.from_dict(wire) == load


def test_draining_is_reported():
    assert ReplicaLoad.from_engine_stats(stats(), draining=True).to_dict()["draining"]


def test_autoscaling_metrics_are_numbers_only():
    metrics = ReplicaLoad.from_engine_stats(stats()).to_autoscaling_metrics()
    assert set(metrics) == set(AUTOSCALING_METRICS)
    assert all(isinstance(v, float) for v in metrics.values())


def test_malformed_dicts():
    with pytest.raises(ValueError):
        ReplicaLoad.from_dict({"kv_usage": 0.1})
    assert ReplicaLoad.try_from_dict({}) is None
    assert ReplicaLoad.try_from_dict(None) is None
    assert ReplicaLoad.try_from_dict({"kv_usage": "x"}) is None


def test_validation():
    with pytest.raises(ValueError):
        ReplicaLoad.from_engine_stats(stats(kv_usage=0.6, num_free_blocks=101))
    with pytest.raises(ValueError):
        ReplicaLoad(kv_usage=1.2, num_waiting=0, num_running=0, num_free_blocks=0,
                    num_total_blocks=0, step_token_rate=0, timestamp=0)
    # kv from the engine is clamped into [0, 1]
    assert ReplicaLoad.from_engine_stats(stats(kv_usage=1.0000001)).kv_usage == 1.0


def test_routing_stats_period_is_at_most_one_second():
    assert 0 < ROUTING_STATS_PERIOD_S <= 1.0


def test_the_wire_dict_is_numbers_and_round_trips():
    # record_routing_stats / record_autoscaling_stats must return numbers: -1 for an
    # unbounded queue, 1.0 / 0.0 for draining.
    wire = {"kv_usage": 0.25, "num_waiting": 3.0, "num_running": 7.0, "num_free_blocks": 75.0,
            "num_total_blocks": 100.0, "num_preemptions": 2.0, "step_token_rate": 10.0,
            "max_waiting_requests": -1.0, "timestamp": 5.0}
    load = ReplicaLoad.from_dict(wire)
    assert load.num_waiting == 3 and load.max_waiting_requests is None and not load.draining
    assert ReplicaLoad.from_dict({**wire, "max_waiting_requests": 8.0, "draining": 1.0}).draining
    for draining in (False, True):
        sent = ReplicaLoad.from_engine_stats(stats(), draining=draining)
        assert all(isinstance(v, float) for v in sent.to_dict().values())
        assert all(isinstance(v, float) for v in sent.to_autoscaling_metrics().values())
        assert ReplicaLoad.from_dict(sent.to_dict()) == sent


def test_cached_block_hashes_round_trip_and_stay_out_of_the_autoscaling_metrics():
    plain = ReplicaLoad.from_engine_stats(stats())
    assert "cached_blocks" not in plain.to_dict() and plain.cached_block_hashes is None
    hashes = [2**64 - 1, 7, 123456789]
    load = plain.with_cached_blocks(hashes, 16)
    wire = pickle.loads(pickle.dumps(load.to_dict()))  # Ray pickles the routing stats
    assert unpack_hashes(wire["cached_blocks"]["device"]) == set(hashes) and wire["block_size"] == 16
    assert len(wire["cached_blocks"]["device"]) == 8 * len(hashes)  # packed: 8 bytes a hash
    back = ReplicaLoad.from_dict(wire)
    assert back == load and back.cached_block_hashes == frozenset(hashes)
    assert back.block_size == 16 and len(back.cached_block_hashes) == 3
    assert load.to_autoscaling_metrics() == plain.to_autoscaling_metrics()
    assert all(isinstance(v, float) for v in load.to_autoscaling_metrics().values())
    assert plain.with_cached_blocks(None, 16) == plain
    empty = ReplicaLoad.from_dict(plain.with_cached_blocks([], 16).to_dict())
    assert empty.cached_block_hashes == frozenset()  # reported, holding nothing
    assert ReplicaLoad.try_from_dict({**wire, "cached_blocks": {"device": b"abc"}}) is None
    assert ReplicaLoad.try_from_dict({**wire, "cached_blocks": "abc"}) is None
    assert ReplicaLoad.try_from_dict({**wire, "block_size": 0}) is None


@pytest.mark.parametrize("tiers", [{"device": [1, 2]}, {"device": [1], "host": [2, 3]},
                                   {"device": [], "host": [5], "disk": [2**64 - 1, 9]},
                                   {"device": [4], "disk": [8]}])
def test_each_tiers_hashes_round_trip(tiers: dict[str, list[int]]) -> None:
    load = ReplicaLoad.from_engine_stats(stats()).with_cached_blocks(tiers, 16)
    back = ReplicaLoad.from_dict(pickle.loads(pickle.dumps(load.to_dict())))
    assert back == load
    assert dict(back.tier_hashes()) == {t: frozenset(h) for t, h in tiers.items()
                                        if h or t == "device"}


def test_the_earlier_wire_form_and_unknown_tiers_still_read() -> None:
    """A replica from before the tiers sent a list of ints under cached_block_hashes (the
    device tier); a newer one may name a tier this router does not know: skipped."""
    plain = ReplicaLoad.from_engine_stats(stats()).to_dict()
    old = ReplicaLoad.from_dict({**plain, "cached_block_hashes": [3, 4], "block_size": 16.0})
    assert old.cached_block_hashes == frozenset({3, 4}) and old.tier_hashes()[1:] == []
    newer = ReplicaLoad.from_dict({**plain, "block_size": 16.0, "cached_blocks": {
        "device": pack_hashes([1]), "host": pack_hashes([2]), "remote": pack_hashes([3])}})
    assert newer.tier_hashes() == [("device", frozenset({1})), ("host", frozenset({2}))]
    with pytest.raises(ValueError, match="tiers"):
        ReplicaLoad.from_engine_stats(stats()).with_cached_blocks({"remote": [1]}, 16)


def test_an_engine_reports_the_kv_bytes_a_token_takes_in_its_cache() -> None:
    """Every layer's K and V of one token, in the cache's dtype: what routers price copies
    of cached blocks by (kv_tier_costs.py, pull_pricing.py)."""
    from iterserve.replica.config import EngineConfig
    from iterserve.replica.llm_engine import LLMEngine
    from iterserve.replica.loader import read_model_config
    from iterserve.replica.make_model import default_model_path

    path = default_model_path()
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), num_gpu_blocks_override=8))
    cfg = read_model_config(path)
    want = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32
    reported = ReplicaLoad.from_engine_stats(engine.stats())
    assert reported.kv_bytes_per_token == want
    assert ReplicaLoad.from_dict(json.loads(json.dumps(reported.to_dict()))) == reported
    assert ReplicaLoad.from_engine_stats(stats()).kv_bytes_per_token == 0  # not reported
