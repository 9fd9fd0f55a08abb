"""The KV-pull tournament's pieces (loadtests/studies/router_tournament/kv_pull.py): which
arms pull at which simulated bandwidth, one small cell run end to end, and its report."""

from __future__ import annotations

from iterserve.loadtests.studies.router_tournament.kv_pull import (
    AWARE,
    BLIND,
    DEFAULT_GB_S,
    OFF,
    build_cells,
    cell_config,
    routers_for,
    run_pull_cell,
)
from iterserve.loadtests.studies.router_tournament.kv_pull_report import report
from iterserve.loadtests.studies.router_tournament.kv_tiers import TIERS


def test_off_pulls_nothing_the_sweep_and_blind_arm_run_on_the_first_seed_only() -> None:
    cells = build_cells([8], 0.8, [0, 1], None, ["multi-turn"], [1.0, DEFAULT_GB_S, 25.0])
    arms = {(c["seed"], c["router"], c["network_gb_s"]) for c in cells}
    assert arms == {(0, OFF, None), (0, AWARE, DEFAULT_GB_S), (0, AWARE, 1.0), (0, AWARE, 25.0),
                    (0, BLIND, DEFAULT_GB_S), (1, OFF, None), (1, AWARE, DEFAULT_GB_S)}
    for cell in cells:
        config = cell_config(cell)
        assert config.kv_tiers == TIERS  # every arm on the same tiered cluster
        if cell["router"] == OFF:
            assert config.kv_pulls is None
        else:
            assert config.kv_pulls.network_gb_s == cell["network_gb_s"]
        aware = [r.kv_pulls for r in routers_for(cell)]
        assert all((p is not None) == (cell["router"] == AWARE) for p in aware)


def test_a_small_pull_cell_runs_and_reports_its_pulls() -> None:
    base = {"workload": "multi-tenant", "replicas": 8, "load": 0.8, "rate": 12.0,
            "duration_s": 5.0, "seed": 0, "num_blocks": 2048}
    cells = [run_pull_cell(dict(base, router=OFF, network_gb_s=None)),
             run_pull_cell(dict(base, router=AWARE, network_gb_s=DEFAULT_GB_S))]
    off, on = cells
    assert off["finished"] == off["requests"] == on["finished"]
    assert off["kv_pulls"] == {} and on["kv_pulls"]["taken"] > 0
    table = report(cells)
    assert "iterserve-pull @ 12.5 GB/s" in table and "p99 of iterserve-pull" in table
