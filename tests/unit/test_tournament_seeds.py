"""The seed check of the tournament's floors on hand-made stores (no simulation)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iterserve.loadtests.studies.router_tournament.tournament import cell_key
from iterserve.loadtests.studies.router_tournament.tournament_seeds import (
    cells_by_seed,
    geometric_mean,
    main,
    report,
    seed_verdicts,
)


def cell(workload: str, load: float, router: str, p99: float, seed: int,
         goodput: float = 10.0) -> dict:
    return {"kind": "router", "workload": workload, "replicas": 8, "load": load,
            "router": router, "cost_scale": None, "seed": seed, "duration_s": 60.0,
            "ttft_p99_s": [p99, p99 * 0.95, p99 * 1.05],
            "goodput_rps": [goodput, goodput * 0.99, goodput * 1.01]}


def store(*cells: dict) -> dict:
    return {"cells": {cell_key(c): c for c in cells}, "capacity": {}}


SEED0 = store(cell("steady", 0.8, "iterserve", 1.08, 0), cell("steady", 0.8, "sglang", 1.0, 0),
              cell("diurnal", 0.8, "iterserve", 1.3, 0), cell("diurnal", 0.8, "sglang", 1.0, 0),
              cell("multi-tenant", 0.5, "iterserve", 1.0, 0),
              cell("multi-tenant", 0.5, "pow2", 1.7, 0))
SEED1 = store(cell("steady", 0.8, "iterserve", 0.98, 1), cell("steady", 0.8, "sglang", 1.0, 1),
              cell("diurnal", 0.8, "iterserve", 1.25, 1), cell("diurnal", 0.8, "sglang", 1.0, 1),
              cell("multi-tenant", 0.5, "iterserve", 1.0, 1),
              cell("multi-tenant", 0.5, "pow2", 2.4, 1),
              cell("steady", 0.5, "sglang", 1.0, 1))  # iterserve never ran it: not judged


def test_a_floor_missed_on_one_seed_is_told_apart_from_one_missed_on_all() -> None:
    verdicts = seed_verdicts(cells_by_seed([SEED0, SEED1]))
    assert set(verdicts) == {("steady", 8, 0.8, "null"), ("diurnal", 8, 0.8, "null"),
                             ("multi-tenant", 8, 0.5, "null")}
    steady = verdicts[("steady", 8, 0.8, "null")]
    assert steady[0]["misses"] == ["p99 (tie)"] and steady[1]["misses"] == []
    assert steady[0]["p99_ratio"] == pytest.approx(1.08) and steady[1]["best_p99"] == "iterserve"
    assert verdicts[("diurnal", 8, 0.8, "null")][1]["misses"] == ["p99"]
    tenant = verdicts[("multi-tenant", 8, 0.5, "null")]
    assert tenant[0]["misses"] == ["pow2-2x"] and tenant[1]["pow2_over_ours"] == pytest.approx(2.4)
    summary = report(verdicts)[-1]
    assert "Missed on every seed: 1 (diurnal/8/0.8)" in summary
    assert "Missed on some seeds only: 2" in summary
    assert "multi-tenant/8/0.5 (seed 0)" in summary and "steady/8/0.8 (seed 0)" in summary


def test_table_rows_and_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = []
    for i, s in enumerate((SEED0, SEED1)):
        paths.append(tmp_path / f"s{i}.json")
        paths[-1].write_text(json.dumps(s))
    out = tmp_path / "seeds.md"
    assert main([str(p) for p in paths] + ["--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Tournament floors on several workload seeds")
    command = "python -m iterserve.loadtests.studies.router_tournament.tournament_seeds"
    assert f"`{command} {paths[0]} {paths[1]}" in text
    assert text.strip().endswith(capsys.readouterr().out.strip())
    row = next(line for line in text.splitlines() if line.startswith("| diurnal"))
    assert "1.300 (sglang): MISS p99" in row and "1.250 (sglang): MISS p99" in row
    assert row.endswith(f"| {geometric_mean([1.3, 1.25]):.3f} | 0 of 2 |")
    tenant = next(line for line in text.splitlines() if line.startswith("| multi-tenant"))
    assert "pow2 1.70x: MISS pow2-2x" in tenant and "pow2 2.40x: ok" in tenant


def test_another_seed_runs_at_the_capacities_a_store_probed(tmp_path: Path) -> None:
    from iterserve.loadtests.studies.router_tournament.tournament import main as tournament_main

    source = tmp_path / "probed.json"
    source.write_text(json.dumps({"cells": {}, "capacity": {'["diurnal", null]': 5.0}}))
    out = tmp_path / "seed1"
    assert tournament_main(["--estimate", "--only", "routers", "--sizes", "8", "--workloads",
                            "diurnal", "--routers", "pow2", "--seed", "1", "--capacity-from",
                            str(source), "--out", str(out)]) == 0
    # No probe ran (one would find ~8 req/s per replica), so the cells run at 5.0 per replica.
    assert json.loads((out / "tournament.json").read_text())["capacity"] == {
        '["diurnal", null]': 5.0}


def test_trace_cells_are_judged_seed_by_seed(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    def traced(router: str, p99: float, seed: int) -> dict:
        return {**cell("chats", 0.8, router, p99, seed), "kind": "trace",
                "trace_sha256": "ab", "speed": 3.0}

    paths = []
    for seed, ours in ((0, 1.0), (1, 1.2)):
        path = tmp_path / f"s{seed}.json"
        path.write_text(json.dumps(store(traced("iterserve", ours, seed),
                                         traced("dynamo", 1.1, seed))))
        paths.append(str(path))
    assert main([*paths, "--kind", "trace"]) == 0
    out = capsys.readouterr().out
    assert "| chats | 8 | 0.8 | - | 1.000 (iterserve): ok | 1.091 (dynamo): MISS p99 (tie)" in out
    assert "Missed on some seeds only: 1 (chats/8/0.8 (seed 1))" in out
