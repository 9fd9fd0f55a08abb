"""The tournament's measured-delay cells: delays read from a replica_startup run in
ClusterSimConfig.startup_delay_s's formula, one store key per delay, and the simulator and the
look-ahead arm both given the cell's delay."""

from __future__ import annotations

import json
from pathlib import Path

from iterserve.loadtests.studies.router_tournament.startup_delays import (
    delay_cells,
    measured_delays,
)
from iterserve.loadtests.studies.router_tournament.tournament import cell_key
from iterserve.loadtests.studies.router_tournament.tournament_cells import autoscaler_for


def stages(**seconds: float) -> dict[str, dict[str, float]]:
    return {k: {"seconds": v, "bytes_read": 0.0, "bytes_copied": 0.0} for k, v in seconds.items()}


def test_a_start_delay_is_every_stage_but_the_first_token(tmp_path: Path) -> None:
    runs = [{"model": "m", "part": "serve", "mode": "warm",
             "stages": stages(actor_start=3.0, imports=1.0, weights_place=2.0, first_token=9.0)},
            {"model": "m", "part": "serve", "mode": "warm",
             "stages": stages(actor_start=5.0, imports=1.0, weights_place=2.0, first_token=9.0)},
            {"model": "m", "part": "offline", "mode": "warm", "stages": stages(imports=99.0)}]
    path = tmp_path / "startup.json"
    path.write_text(json.dumps({"runs": runs}))
    assert measured_delays(path) == {"m warm": 7.0}  # the median of 6 and 8


def test_cells_of_each_delay_are_stored_apart_and_look_that_far_ahead() -> None:
    short, constant = delay_cells(10.0, 5.5, [360.0]), delay_cells(10.0, 30.0, [360.0])
    assert len(short) == 2 * 3 * 6  # loads x seeds x (4 autoscalers, fixed-peak, ahead)
    keys = {cell_key(c) for c in short} | {cell_key(c) for c in constant}
    assert len(keys) == len(short) + len(constant)
    ahead = next(c for c in short if c["autoscaler"] == "iterserve-ahead")
    scaler = autoscaler_for("iterserve-ahead", 2, 8, 8, ahead["startup_delay_s"])
    assert scaler.name == "iterserve-ahead" and scaler.config.startup_s == 5.5
