"""The tournament's judgement without simulating: floors, SLO scaling, autoscaler verdicts,
the CPU-time estimate and the rendered report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iterserve.loadtests.studies.router_tournament.tournament import (
    autoscaler_cells,
    cell_duration_s,
    cell_key,
)
from iterserve.loadtests.studies.router_tournament.tournament_cells import slo_scale
from iterserve.loadtests.studies.router_tournament.tournament_estimate import cell_cpu_s, fit
from iterserve.loadtests.studies.router_tournament.tournament_report import (
    autoscaler_verdict,
    floor_check,
    misses,
    write_report,
)


def row(router: str, p99: float, goodput: float, **extra: object) -> dict:
    return {"router": router, "ttft_p99_s": [p99, p99 * 0.95, p99 * 1.05],
            "goodput_rps": [goodput, goodput * 0.99, goodput * 1.01], **extra}


def test_slo_scales_only_with_every_coefficient():
    assert slo_scale({"*": 2.0}) == 2.0
    assert slo_scale({"*": 0.5}) == 0.5
    assert slo_scale(None) == 1.0
    assert slo_scale({"a_s": 0.5}) == 1.0


def test_floors_p99_goodput_and_pow2_factor():
    rows = [row("iterserve", 1.0, 10.0), row("pow2", 1.5, 10.0), row("sglang", 1.02, 10.0)]
    check = floor_check(rows)
    assert check["best_p99"] == "iterserve" and check["p99_within_5pct"]
    assert misses("steady", check) == []
    assert misses("multi-tenant", check) == ["pow2-2x"]  # 1.5x < 2x
    worse = floor_check([row("iterserve", 1.2, 9.0), row("sglang", 1.0, 10.0)])
    assert misses("steady", worse) == ["p99", "goodput"]  # intervals apart: no '(tie)'
    close = floor_check([row("iterserve", 1.07, 10.0), row("sglang", 1.0, 10.0)])
    assert misses("steady", close) == ["p99 (tie)"]


def test_iterserve_variants_are_not_the_best_to_beat():
    check = floor_check([row("iterserve", 1.0, 10.0), row("iterserve-nocache", 0.5, 12.0)])
    assert check["best_p99"] == "iterserve" and misses("steady", check) == []


def test_autoscaler_verdict_against_the_cheapest_baseline_meeting_the_slo():
    def a(name: str, gpu_h: float, attained: float) -> dict:
        return {"autoscaler": name, "gpu_hours": gpu_h, "ttft_slo_attainment": attained}

    ok, text = autoscaler_verdict([a("iterserve", 0.7, 1.0), a("keda-threshold", 0.6, 0.8),
                                   a("fixed", 0.8, 1.0)])
    assert ok and "fixed" in text  # keda is cheaper but misses the SLO
    ok, _ = autoscaler_verdict([a("iterserve", 0.7, 1.0), a("keda-threshold", 0.65, 0.995)])
    assert ok is False
    ok, text = autoscaler_verdict([a("iterserve", 0.5, 0.98), a("fixed", 0.8, 1.0)])
    assert ok is False and "MISSES" in text


def test_cells_have_enough_requests_and_distinct_keys():
    assert cell_duration_s(8, 10.0) == pytest.approx(200.0)  # 2000 requests
    assert cell_duration_s(128, 1000.0) == 15.0
    cells = autoscaler_cells(8.0, 0, 0.4, 360.0) + autoscaler_cells(8.0, 0, 0.8, 600.0)
    assert len({cell_key(c) for c in cells}) == len(cells)


def test_estimate_fits_the_measured_cells():
    cells = [{"kind": "router", "replicas": n, "duration_s": d, "rate": r,
              "cpu_s": d * (0.01 * n + 0.002 * r + 1e-4 * r * n)}
             for n, d, r in [(8, 60, 50), (8, 100, 20), (32, 30, 200), (32, 30, 600),
                             (64, 20, 400), (128, 15, 900), (8, 200, 10)]]
    coeffs, fitted = fit(cells)
    assert fitted == 7
    assert coeffs == pytest.approx((0.01, 0.002, 1e-4), rel=1e-6)
    assert cell_cpu_s(cells[0], coeffs) == pytest.approx(cells[0]["cpu_s"])
    assert fit(cells[:3])[1] == 0  # too few: the defaults


def test_report_renders_tables_matrix_and_plots(tmp_path: Path) -> None:
    base = {"kind": "router", "workload": "multi-tenant", "replicas": 8, "rate": 20.0,
            "duration_s": 100.0, "requests": 2000, "itl_p99_s": 0.07, "throughput_tok_s": 1.0,
            "ttft_p50_s": [0.1, 0.1, 0.1], "preemptions": 0, "prefix_hit_rate": 0.5,
            "cost_scale": None, "seed": 0, "cpu_s": 3.0}
    cells = []
    for load in (0.5, 0.95):
        cells += [{**base, **row("iterserve", load, 20.0), "load": load},
                  {**base, **row("pow2", 3 * load, 20.0), "load": load}]
    sens = {**base, "kind": "sensitivity", "load": 0.8, "cost_scale": {"*": 2.0},
            "slo_ttft_s": 4.0, "slo_itl_s": 0.2}
    cells += [{**sens, **row("iterserve", 1.0, 5.0), "goodput_unscaled_rps": [1.0, 0.9, 1.1]},
              {**sens, **row("pow2", 1.5, 5.0), "goodput_unscaled_rps": [2.0, 1.9, 2.1]}]
    auto = {"kind": "autoscaler", "workload": "diurnal", "replicas": 8, "rate": 25.0,
            "duration_s": 360.0, "load": 0.4, "seed": 0, "ttft_p99_s": [0.1, 0.1, 0.1],
            "goodput_rps": [25.0, 25.0, 25.0], "end_time_s": 361.0,
            "replicas_over_time": [[0.0, 8, 0], [60.0, 4, 0]]}
    cells += [{**auto, "autoscaler": "iterserve", "gpu_hours": 0.5,
               "ttft_slo_attainment": 1.0},
              {**auto, "autoscaler": "fixed", "label": "fixed-8", "gpu_hours": 0.8,
               "ttft_slo_attainment": 1.0}]
    store = {"cells": {json.dumps(i): c for i, c in enumerate(cells)}, "capacity": {},
             "commands": ["python -m iterserve.loadtests.studies.router_tournament.tournament"
                          " --only routers"]}
    write_report(store, tmp_path, "t")
    md = (tmp_path / "t.md").read_text()
    assert "## Floors at a glance" in md and "| multi-tenant | 8 | ok, pow2 3.0x |" in md
    assert "goodput, unscaled SLO" in md and "SLO TTFT <= 4 s, ITL <= 0.2 s" in md
    # the x2 cell: pow2 only 1.5x slower; goodput tied under the scaled SLO, last unscaled
    assert "| multi-tenant | {\"*\": 2.0} | 4 s, 0.2 s | 1 of 2 | 1= of 2 | 2 of 2 | MISS pow2-2x |" in md
    assert "no more than the cheapest baseline" in md
    assert (tmp_path / "t_p99_ttft.png").exists() and (tmp_path / "t_replicas.png").exists()
