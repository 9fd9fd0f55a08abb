"""The no-router-can-beat-it TTFT bound: every simulated request's real TTFT is at least
its bound, under a cache-blind and a cache-aware router, and the idle TTFT behaves as
the cost model says (cold > warm, longer > shorter)."""

from __future__ import annotations

import dataclasses

from iterserve.autoscale.sim.baseline_routers import PowerOfTwoRouter
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.autoscale.sim.shapes import make
from iterserve.loadtests.studies.prefill_bound.prefill_bound import (
    cold_prefixes,
    idle_ttft,
    per_request_bounds,
)
from iterserve.loadtests.studies.router_tournament.tournament_cells import sim_config


def test_idle_ttft_charges_the_uncached_tokens() -> None:
    config = sim_config()
    cold, warm = idle_ttft(config, 0, 7000), idle_ttft(config, 6000, 7000)
    cost = config.sim.cost
    # 7,000 uncached tokens take at least their per-token prefill cost
    assert cold >= cost.b_s_per_prefill_token * 7000
    assert warm < cold / 3  # only ~1,000 tokens left to compute
    assert idle_ttft(config, 6000, 7500) > warm


def test_no_simulated_request_beats_its_bound() -> None:
    config = dataclasses.replace(sim_config(), seed=3)
    requests = make("multi-tenant", 6.0, 20.0, seed=3)
    ordered = sorted(requests, key=lambda r: r.arrival_time)
    bounds = dict(zip((r.request_id for r in ordered), per_request_bounds(requests, config),
                      strict=True))
    assert 0 < cold_prefixes(requests) <= 150
    for make_router in (PowerOfTwoRouter, IterserveRouter):
        result = simulate(requests, [make_router(), make_router()], 2, config)
        ttfts = {r.request_id: r.ttft for r in result.records}
        assert len(ttfts) == len(requests)
        slack = [ttfts[rid] - bound for rid, bound in bounds.items()]
        assert min(slack) >= -1e-9, make_router.__name__
        # and the bound is not vacuous: some request comes within 1 ms of it
        assert min(slack) < 1e-3
