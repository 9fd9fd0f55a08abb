"""The tournament's autoscaler cells with measured replica start-ups beside the 30 s constant.

    python -m iterserve.loadtests.studies.router_tournament.startup_delays \
        [--startup-from loadtests/studies/replica_startup/results/startup.json] \
        [--delays S ...] [--durations 360 600] [--jobs 2]

The delays: 30 s (the simulator's default) and, from a replica_startup run, the shortest and
the longest median Serve start (model, cold or warm) in `ClusterSimConfig.startup_delay_s`'s
formula (every stage but first_token). Each delay runs tournament.autoscaler_cells (diurnal
with a 3x spike in 10 s, loads 0.4 and 0.8, seeds 0-2; the 30 s cells are those of
tournament.json, run again here) plus `iterserve-ahead`, iterserve's policy looking one
start-up ahead (AutoscaleConfig.startup_s = the delay). Writes startup_delays.json (the
store) and startup_delays.md (per delay: GPU-hours and SLO attainment, the verdict of
tournament_report against the cheapest baseline meeting the SLO).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iterserve.loadtests.studies import results_of
from iterserve.loadtests.studies.router_tournament.tournament import (
    AUTOSCALE_DURATIONS_S,
    AUTOSCALE_LOADS,
    AUTOSCALE_SEEDS,
    autoscaler_cells,
    cell_key,
    run_all,
)
from iterserve.loadtests.studies.router_tournament.tournament_report import autoscaler_verdict

DEFAULT_DELAY_S = 30.0
STARTUP_RESULTS = results_of("replica_startup") / "startup.json"


def measured_delays(path: Path) -> dict[str, float]:
    """{"model mode": median Serve start-up without first_token} from a replica_startup run."""
    runs = json.loads(path.read_text())["runs"]
    starts: dict[str, list[float]] = defaultdict(list)
    for run in runs:
        if run["part"] == "serve":
            stages = run["stages"]
            starts[f"{run['model']} {run['mode']}"].append(
                sum(s["seconds"] for name, s in stages.items() if name != "first_token"))
    return {name: statistics.median(values) for name, values in starts.items()}


def delay_cells(cap: float, delay: float, durations: Sequence[float]) -> list[dict[str, Any]]:
    cells = []
    for load in AUTOSCALE_LOADS:
        for duration in durations:
            for seed in AUTOSCALE_SEEDS:
                group = autoscaler_cells(cap, seed, load, duration)
                ours = next(c for c in group if c["autoscaler"] == "iterserve")
                group.append({**ours, "autoscaler": "iterserve-ahead"})
                cells += [{**cell, "startup_delay_s": delay} for cell in group]
    return cells


def reuse_constant_cells(store: dict[str, Any], cells: list[dict[str, Any]],
                         tournament: dict[str, Any]) -> None:
    """The 30 s cells tournament.json already holds, taken as they are (the simulator is
    deterministic: a stored cell run again gives the same JSON), so only what it lacks runs."""
    for cell in cells:
        if cell["startup_delay_s"] != DEFAULT_DELAY_S or cell_key(cell) in store["cells"]:
            continue
        stored = tournament["cells"].get(cell_key({k: v for k, v in cell.items()
                                                   if k != "startup_delay_s"}))
        if stored is not None and stored.get("label") == cell.get("label"):
            store["cells"][cell_key(cell)] = {**stored, "startup_delay_s": DEFAULT_DELAY_S}


def report(cells: list[dict[str, Any]], delays: dict[str, float]) -> list[str]:
    names = {round(v, 3): k for k, v in delays.items()}
    lines = ["# Autoscaler cells at measured replica start-ups", "",
             "Diurnal with a 3x spike within 10 s (tournament.autoscaler_cells); a cell meets "
             "the SLO when >= 99 % of its requests have TTFT <= 2 s. `ahead`: iterserve's policy "
             "with AutoscaleConfig.startup_s = the start-up (its look-ahead).", "",
             "| start-up s | load | virtual s | seed | iterserve GPU-h / SLO | ahead GPU-h / SLO "
             "| cheapest baseline meeting the SLO | iterserve | ahead |",
             "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for c in cells:
        groups[(c["startup_delay_s"], c["load"], c["duration_s"], c["seed"])].append(c)
    for (delay, load, duration, seed), rows in sorted(groups.items()):
        by = {r.get("label") or r["autoscaler"]: r for r in rows}
        ours, ahead = by.get("iterserve"), by.get("iterserve-ahead")
        baselines = [r for r in rows if r["autoscaler"] not in ("iterserve", "iterserve-ahead")]
        ok, _ = autoscaler_verdict([r for r in rows if r["autoscaler"] != "iterserve-ahead"])
        ok_ahead, _ = autoscaler_verdict(
            baselines + ([{**ahead, "autoscaler": "iterserve"}] if ahead else []))
        meeting = sorted((r["gpu_hours"], r.get("label") or r["autoscaler"]) for r in baselines
                         if r["ttft_slo_attainment"] >= 0.99)
        best = f"{meeting[0][1]} {meeting[0][0]:.3f}" if meeting else "none"
        cell = (lambda r: "-" if r is None else
                f"{r['gpu_hours']:.3f} / {100 * r['ttft_slo_attainment']:.2f} %")
        label = names.get(round(delay, 3), "constant")
        lines.append(f"| {delay:.1f} ({label}) | {load} | {duration:.0f} | {seed} | {cell(ours)} "
                     f"| {cell(ahead)} | {best} | {'ok' if ok else 'MISS'} | "
                     f"{'ok' if ok_ahead else 'MISS'} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--startup-from", type=Path, default=STARTUP_RESULTS,
                        help="a replica_startup run (startup.json) to take the delays from")
    parser.add_argument("--delays", nargs="*", type=float, default=None,
                        help="start-up delays in seconds (default: 30 and the shortest and "
                        "longest measured Serve start)")
    parser.add_argument("--durations", nargs="*", type=float,
                        default=list(AUTOSCALE_DURATIONS_S), help="virtual seconds per cell")
    parser.add_argument("--jobs", type=int, default=2, help="cells simulated in parallel")
    parser.add_argument("--out", type=Path, default=results_of("router_tournament"),
                        help="folder of startup_delays.json/.md and of tournament.json, "
                        "whose probed diurnal capacity the cells run at")
    args = parser.parse_args(argv)
    measured = measured_delays(args.startup_from)
    delays = {"constant": DEFAULT_DELAY_S}
    if args.delays is not None:
        delays.update({f"given {d:g}": d for d in args.delays})
    else:
        shortest = min(measured, key=measured.__getitem__)
        longest = max(measured, key=measured.__getitem__)
        delays.update({shortest: measured[shortest], longest: measured[longest]})
    tournament = json.loads((args.out / "tournament.json").read_text())
    cap = next(v for k, v in tournament["capacity"].items() if json.loads(k)[0] == "diurnal"
               and json.loads(k)[1] is None)
    cells = [c for d in delays.values() for c in delay_cells(cap, d, args.durations)]
    path = args.out / "startup_delays.json"
    store = json.loads(path.read_text()) if path.exists() else {"cells": {}}
    store["measured_delays"] = measured
    reuse_constant_cells(store, cells, tournament)
    run_all(cells, args.jobs, store, path)
    done = [c for c in store["cells"].values()
            if any(abs(c["startup_delay_s"] - d) < 1e-9 for d in delays.values())]
    (args.out / "startup_delays.md").write_text("\n".join(report(done, delays)) + "\n")
    print("\n".join(report(done, delays)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
