"""router_arm: an arm that is the stored router reproduces it exactly; another arm is
judged in iterserve's place against the same stored contestants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iterserve.loadtests.studies.router_arms.router_arm import main
from iterserve.loadtests.studies.router_tournament.tournament import cell_key
from iterserve.loadtests.studies.router_tournament.tournament_cells import run_cell

BASE = {"kind": "router", "workload": "multi-turn", "replicas": 4, "load": 0.9, "rate": 40.0,
        "duration_s": 8.0, "seed": 3, "cost_scale": None, "autoscaler": None}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cells = [run_cell(BASE | {"router": router}) for router in ("iterserve", "pow2")]
    path = tmp_path_factory.mktemp("arm") / "tournament.json"
    path.write_text(json.dumps({"cells": {cell_key(c): c for c in cells}}))
    return path


def test_the_stored_router_as_its_own_arm_reproduces_every_cell(
        store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "arm.json"
    assert main([str(store), "--arm", "iterserve", "--sizes", "4", "--jobs", "1",
                 "--store", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| all | 1 | 1.000 | 1.000 | 1.000 |" in printed
    rerun = next(iter(json.loads(out.read_text())["cells"].values()))
    stored = json.loads(store.read_text())["cells"][cell_key(BASE | {"router": "iterserve"})]
    assert rerun["ttft_p99_s"] == stored["ttft_p99_s"]
    assert rerun["router"] == "iterserve"
    assert rerun["arm"] == {"router": "iterserve", "router_sync_delay_s": None}


def test_an_arm_with_router_sync_is_judged_in_iterserves_place(
        store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md, out = tmp_path / "arm.md", tmp_path / "arm.json"
    assert main([str(store), "--arm", "iterserve-waitdrain", "--sync", "0.01", "--sizes",
                 "4", "--jobs", "1", "--out", str(md), "--store", str(out)]) == 0
    rerun = next(iter(json.loads(out.read_text())["cells"].values()))
    stored = json.loads(store.read_text())["cells"][cell_key(BASE | {"router": "iterserve"})]
    assert rerun["ttft_p50_s"] != stored["ttft_p50_s"]
    assert rerun["arm"] == {"router": "iterserve-waitdrain", "router_sync_delay_s": 0.01}
    text = md.read_text()
    assert text.startswith("# Router arm: iterserve-waitdrain, router sync 0.01 s")
    assert "Stored iterserve:" in text and "multi-turn | 4 | 0.9" in text
    capsys.readouterr()


def test_no_cells_at_the_sizes_asked_is_an_error(store: Path) -> None:
    with pytest.raises(SystemExit):
        main([str(store), "--arm", "iterserve", "--sizes", "64"])


def test_sensitivity_cells_are_rerun_with_their_cost_scale(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scaled = BASE | {"kind": "sensitivity", "cost_scale": {"*": 2.0}, "rate": 20.0}
    cells = [run_cell(scaled | {"router": router}) for router in ("iterserve", "pow2")]
    path = tmp_path / "tournament.json"
    path.write_text(json.dumps({"cells": {cell_key(c): c for c in cells}}))
    assert main([str(path), "--arm", "iterserve", "--kind", "sensitivity", "--sizes", "4",
                 "--jobs", "1"]) == 0
    printed = capsys.readouterr().out
    assert "| all | 1 | 1.000 | 1.000 | 1.000 |" in printed
    assert '| multi-turn | 4 | 0.9 | {"*": 2.0} |' in printed
    with pytest.raises(SystemExit):  # no router-kind cells in this store
        main([str(path), "--arm", "iterserve", "--sizes", "4"])
