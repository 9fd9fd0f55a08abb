"""sim_validation simulates the router each Ray run had: the RouterConfig that
routing_experiment records per iterserve arm, or, for older results that record none, the
settings the Ray adapter then ran with (no replica cache answers, no prefill drain)."""

from __future__ import annotations

from pathlib import Path

import pytest

from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.loadtests.studies.ray_routing.routing_experiment import ARMS, iterserve_router_config
from iterserve.loadtests.studies.sim_validation.sim_validation import ARM_ROUTERS, PowerOfTwo, sim_router


def test_the_ray_run_records_a_config_for_iterserve_arms_only() -> None:
    recorded = {arm: iterserve_router_config(arm, 0.5) for arm in ARMS}
    assert recorded["pow2 (Ray default)"] is None
    assert recorded["PrefixCacheAffinityRouter (Ray 2.60)"] is None
    kvaware = recorded["KVAware"]
    assert kvaware is not None and not kvaware.prefix_affinity
    assert kvaware.routing_stats_period_s == 0.5 and kvaware.use_replica_cache_reports
    assert not recorded["KVAware + prefix, no cache reports"].use_replica_cache_reports


def test_a_recorded_config_is_the_simulated_router() -> None:
    config = iterserve_router_config("KVAware + prefix", 0.25)
    router = sim_router("KVAware + prefix", 0.25, config.model_dump())
    assert isinstance(router, IterserveRouter)
    assert router.core.config == config and router.use_replica_cache


def test_results_without_a_config_get_the_router_the_adapter_ran_then() -> None:
    router = sim_router("KVAware", 0.5, None)
    assert isinstance(router, IterserveRouter) and not router.use_replica_cache
    config = router.core.config
    assert not config.drain_inflight_prefill and not config.prefix_affinity
    assert config.routing_stats_period_s == 0.5
    assert sim_router("KVAware + prefix", 0.5, None).core.config.prefix_affinity
    assert isinstance(sim_router("pow2 (Ray default)", 0.5, None), PowerOfTwo)
    assert set(ARM_ROUTERS) <= set(ARMS)
    with pytest.raises(SystemExit):
        sim_router("an arm nobody ran", 0.5, None)


def test_two_runs_of_one_arm_are_told_apart_and_keep_their_own_configs(tmp_path: Path) -> None:
    import json

    from iterserve.loadtests.studies.sim_validation.sim_validation import load_ray_results

    meta = {"workload": {"seed": 0}, "engine_kwargs": {}, "time_scale": 5.0}
    config = iterserve_router_config("KVAware", 0.5).model_dump()
    old = {"meta": {**meta, "when": "2026-12-01 21:32 UTC"},
           "results": [{"summary": {"arm": "KVAware"}}, {"summary": {"arm": "pow2 (Ray default)"}}]}
    new = {"meta": {**meta, "when": "2026-12-03 07:19 UTC", "router_configs": {"KVAware": config}},
           "results": [{"summary": {"arm": "KVAware"}}]}
    paths = [tmp_path / "old.json", tmp_path / "new.json"]
    for path, data in zip(paths, (old, new), strict=True):
        path.write_text(json.dumps(data))
    results = load_ray_results(paths)["results"]
    assert [r["label"] for r in results] == [
        "KVAware (Ray run 2026-12-01 21:32 UTC)", "pow2 (Ray default)",
        "KVAware (Ray run 2026-12-03 07:19 UTC)"]
    assert [r["router_config"] for r in results] == [None, None, config]
