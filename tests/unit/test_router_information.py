"""router_information: its tournament-setting variant is the tournament's cell, and the
variants (router count, stats period, router sync) really change what the routers see."""

from __future__ import annotations

import pytest

from iterserve.loadtests.studies.router_arms.router_information import (
    label,
    parse_variant,
    run_variant,
    table,
)
from iterserve.loadtests.studies.router_tournament.tournament_cells import NUM_INGRESS_ROUTERS, run_cell

CELL = {"kind": "router", "workload": "multi-turn", "replicas": 4, "load": 0.9, "rate": 40.0,
        "duration_s": 8.0, "router": "iterserve", "seed": 3, "cost_scale": None}


def variant(routers: int, period: float, sync: float | None = None) -> dict:
    return run_variant(CELL["workload"], CELL["replicas"], CELL["rate"], CELL["duration_s"],
                       CELL["seed"], CELL["router"], (routers, period, sync), None)


def test_the_tournament_setting_reproduces_the_tournament_cell() -> None:
    ours = variant(NUM_INGRESS_ROUTERS, 0.5)
    cell = run_cell(CELL)
    for key in ("ttft_p99_s", "ttft_p50_s", "goodput_rps", "requests"):
        assert ours[key] == cell[key], key


def test_fewer_routers_and_fresher_stats_change_the_run() -> None:
    base = variant(NUM_INGRESS_ROUTERS, 0.5)["ttft_p50_s"]
    assert variant(1, 0.5)["ttft_p50_s"] != base
    assert variant(NUM_INGRESS_ROUTERS, 0.01)["ttft_p50_s"] != base
    assert variant(NUM_INGRESS_ROUTERS, 0.5, 0.01)["ttft_p50_s"] != base


def test_variants_parse_and_render() -> None:
    assert parse_variant("1:0.01") == (1, 0.01, None)
    assert parse_variant("2:0.5:0.01") == (2, 0.5, 0.01)
    assert label("iterserve", (2, 0.5, 0.01)) == "iterserve, 2 : 0.5 s, sync 0.01 s"
    for bad in ("0:0.5", "2:0", "2", "2:0.5:-1", "2:0.5:0.1:1"):
        with pytest.raises(ValueError):
            parse_variant(bad)
    lines = table({"pow2, 2 : 0.5 s": {0: 0.5, 1: 0.25}}, [0, 1])
    assert lines[-1] == "| pow2, 2 : 0.5 s | 0.500 | 0.250 |"
