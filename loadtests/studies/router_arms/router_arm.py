"""A router arm against stored tournaments: iterserve's cells rerun with another router
configuration or more information, judged beside the stored contestants as the tournament
judges iterserve.

    python -m iterserve.loadtests.studies.router_arms.router_arm \
        loadtests/studies/router_tournament/results/tournament.json \
        loadtests/studies/router_tournament/results/tournament_seeds/seed1.json ... \
        --arm iterserve-waitdrain \
        [--sync 0.01] [--sizes 8 32] [--kind router|sensitivity] [--jobs 2] [--out FILE.md] \
        [--store FILE.json]

Every stored iterserve cell of the kind (router: no cost scaling; sensitivity: the cells
with every cost coefficient halved or doubled) at --sizes is rerun at its stored rate,
duration and seed with the router `--arm` (a name in `tournament_cells.ROUTERS`) and, with
--sync S, router sync: each ingress router hears of the other's sends and completions S
seconds after them (`ClusterSimConfig.router_sync_delay_s`, Dynamo's router replica sync;
the Ray adapters have no such channel today). The other routers' stored cells are kept, so
the arm faces the same contestants on the same requests. Printed: the arm's p99 TTFT over
the stored iterserve's per workload (geometric mean, min, max), and `tournament_seeds`'s
floor table for the stored router and for the arm. --store writes the arm's cells (router
"iterserve", `arm` saying what ran).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from iterserve.loadtests.studies.router_tournament.tournament import cell_key
from iterserve.loadtests.studies.router_tournament.tournament_cells import ROUTERS, run_cell
from iterserve.loadtests.studies.router_tournament.tournament_report import OURS
from iterserve.loadtests.studies.router_tournament.tournament_seeds import (
    cells_by_seed,
    geometric_mean,
    report,
    seed_verdicts,
)

RUN_KEYS = ("kind", "workload", "replicas", "load", "rate", "duration_s", "seed",
            "cost_scale")


def arm_cells(stores: Sequence[dict[str, Any]], sizes: Sequence[int], kind: str = "router"
              ) -> list[dict[str, Any]]:
    """The stored iterserve cells of `kind` to rerun, at the given sizes."""
    return [cell for store in stores for cell in store["cells"].values()
            if cell["kind"] == kind and cell["router"] == OURS and cell["replicas"] in sizes]


def run_arm(stored: dict[str, Any], arm: str, sync: float | None) -> dict[str, Any]:
    """One stored iterserve cell rerun as the arm, labelled as iterserve for judging."""
    cell = {k: stored[k] for k in RUN_KEYS} | {"router": arm}
    if sync is not None:
        cell["router_sync_delay_s"] = sync
    out = dict(stored) | run_cell(cell)
    out["router"] = OURS
    out["arm"] = {"router": arm, "router_sync_delay_s": sync}
    out.pop("router_sync_delay_s", None)
    return out


def with_arm(stores: Sequence[dict[str, Any]], reruns: Sequence[dict[str, Any]]
             ) -> list[dict[str, Any]]:
    """The stores with each rerun cell in place of the stored cell it reran."""
    replaced = {cell_key(c): c for c in reruns}
    return [{"cells": {k: replaced.get(k, c) for k, c in store["cells"].items()}}
            for store in stores]


def ratios_by_workload(stored: Sequence[dict[str, Any]], reruns: Sequence[dict[str, Any]]
                       ) -> dict[str, list[float]]:
    """Per workload: the arm's p99 TTFT over the stored cell's, cell by cell."""
    old = {cell_key(c): c["ttft_p99_s"][0] for c in stored}
    out: dict[str, list[float]] = defaultdict(list)
    for cell in reruns:
        out[cell["workload"]].append(cell["ttft_p99_s"][0] / old[cell_key(cell)])
    return dict(out)


def ratio_lines(ratios: dict[str, list[float]]) -> list[str]:
    lines = ["| workload | cells | arm / stored p99 TTFT: geo-mean | min | max |",
             "|---|---|---|---|---|"]
    everything: list[float] = []
    for workload, values in sorted(ratios.items()):
        everything += values
        lines.append(f"| {workload} | {len(values)} | {geometric_mean(values):.3f} | "
                     f"{min(values):.3f} | {max(values):.3f} |")
    if everything:
        lines.append(f"| all | {len(everything)} | {geometric_mean(everything):.3f} | "
                     f"{min(everything):.3f} | {max(everything):.3f} |")
    return lines


def floor_lines(stores: Sequence[dict[str, Any]], sizes: Sequence[int], kind: str
                ) -> list[str]:
    verdicts = {k: v for k, v in seed_verdicts(cells_by_seed(stores, kind)).items()
                if k[1] in sizes}
    return report(verdicts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stores", nargs="+", type=Path, help="tournament.json files")
    parser.add_argument("--arm", required=True, choices=sorted(ROUTERS),
                        help="the router to rerun in iterserve's cells")
    parser.add_argument("--sync", type=float, default=None,
                        help="router sync delay (s): routers hear each other's sends")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32],
                        help="replica counts whose cells are rerun")
    parser.add_argument("--kind", choices=("router", "sensitivity"), default="router",
                        help="the stores' router cells or their cost-sensitivity cells")
    parser.add_argument("--jobs", type=int, default=2, help="cells simulated in parallel")
    parser.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    parser.add_argument("--store", type=Path, help="write the arm's cells here (JSON)")
    args = parser.parse_args(argv)
    if args.sync is not None and args.sync < 0:
        parser.error("--sync must be >= 0")
    stores = [json.loads(p.read_text()) for p in args.stores]
    stored = arm_cells(stores, args.sizes, args.kind)
    if not stored:
        parser.error(f"no iterserve {args.kind} cells at sizes {args.sizes} in these stores")
    print(f"rerunning {len(stored)} cells as {args.arm}"
          + ("" if args.sync is None else f" with router sync {args.sync} s"), flush=True)
    with ProcessPoolExecutor(args.jobs) as pool:
        reruns = list(pool.map(run_arm, stored, [args.arm] * len(stored),
                               [args.sync] * len(stored)))
    arm = f"{args.arm}" + ("" if args.sync is None else f", router sync {args.sync} s")
    lines = ratio_lines(ratios_by_workload(stored, reruns))
    lines += ["", "Stored iterserve:", ""] + floor_lines(stores, args.sizes, args.kind)
    lines += ["", f"Arm ({arm}):", ""] + floor_lines(with_arm(stores, reruns), args.sizes,
                                                      args.kind)
    print("\n".join(lines))
    command = "python -m iterserve.loadtests.studies.router_arms.router_arm " + " ".join(
        sys.argv[1:] if argv is None else argv)
    if args.out is not None:
        head = [f"# Router arm: {arm}", "", f"`{command}`", ""]
        args.out.write_text("\n".join(head + lines) + "\n")
    if args.store is not None:
        args.store.write_text(json.dumps({"command": command,
                                          "cells": {cell_key(c): c for c in reruns}},
                                         indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
