"""Do the tournament's floor verdicts hold on workload seeds the routers were not tuned on?

    python -m iterserve.loadtests.studies.router_tournament.tournament_seeds \
        loadtests/studies/router_tournament/results/tournament.json \
        RUN_SEED1/tournament.json RUN_SEED2/tournament.json [--out FILE.md]

Each store is a `tournament` run (`--seed s` draws both the workload and the simulator's
randomness from s). Cells are grouped per seed exactly as the report groups them and each
(cell, seed) is judged by the report's own `floor_check` / `misses`; a cell is listed with
every seed's ratio of iterserve's p99 TTFT to the best router's, the best router, the floors
missed, and on the pow2-floor workloads pow2's p99 over ours. A floor held on one seed and
missed on another is a property of that seed, not of the router; one missed on every seed
is the router's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iterserve.loadtests.studies.router_tournament.tournament_report import (
    OURS,
    POW2_FLOOR_WORKLOADS,
    floor_check,
    group_cells,
    misses,
)

CellKey = tuple[str, int, float, str]  # workload, replicas, load, cost scale (JSON)


def cells_by_seed(stores: Sequence[dict[str, Any]], kind: str = "router"
                  ) -> dict[int, dict[CellKey, list[dict[str, Any]]]]:
    """{seed: {cell: rows}}; a later store's cells of a seed replace an earlier one's."""
    per_seed: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for store in stores:
        for cell in store["cells"].values():
            per_seed[int(cell["seed"])].append(cell)
    return {seed: group_cells(cells, kind) for seed, cells in sorted(per_seed.items())}


def judge(workload: str, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One (cell, seed): ours / best p99 and goodput, the best router, the floors missed."""
    check = floor_check(rows)
    if "p99_within_5pct" not in check:
        return None
    by_router = {r["router"]: r for r in rows}
    ours, best = by_router[OURS], by_router[check["best_p99"]]
    best_good = by_router[check["best_goodput"]]
    return {"p99_ratio": ours["ttft_p99_s"][0] / best["ttft_p99_s"][0],
            "best_p99": check["best_p99"],
            "goodput_ratio": ours["goodput_rps"][0] / best_good["goodput_rps"][0],
            "pow2_over_ours": check.get("pow2_over_ours_p99"),
            "misses": misses(workload, check)}


def seed_verdicts(per_seed: dict[int, dict[CellKey, list[dict[str, Any]]]]
                  ) -> dict[CellKey, dict[int, dict[str, Any]]]:
    """{cell: {seed: judgement}} over the cells iterserve ran on at least one seed."""
    out: dict[CellKey, dict[int, dict[str, Any]]] = defaultdict(dict)
    for seed, groups in per_seed.items():
        for key, rows in groups.items():
            verdict = judge(key[0], rows)
            if verdict is not None:
                out[key][seed] = verdict
    return dict(out)


def _cell_text(v: dict[str, Any], pow2_floor: bool) -> str:
    text = f"{v['p99_ratio']:.3f} ({v['best_p99']})"
    if pow2_floor and v["pow2_over_ours"] is not None:
        text += f", pow2 {v['pow2_over_ours']:.2f}x"
    return text + (": MISS " + ", ".join(v["misses"]) if v["misses"] else ": ok")


def geometric_mean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def report(verdicts: dict[CellKey, dict[int, dict[str, Any]]]) -> list[str]:
    seeds = sorted({s for per in verdicts.values() for s in per})
    lines = ["| workload | replicas | load | cost scale | "
             + " | ".join(f"seed {s}: ours / best p99 (best)" for s in seeds)
             + " | geo-mean p99 ratio | floors held |",
             "|---|---|---|---|" + "---|" * len(seeds) + "---|---|"]
    everywhere: list[str] = []
    somewhere: list[str] = []
    for key in sorted(verdicts, key=lambda k: (k[0], k[1], k[2], k[3])):
        workload, n, load, scale = key
        per = verdicts[key]
        cols = [_cell_text(per[s], workload in POW2_FLOOR_WORKLOADS) if s in per else "-"
                for s in seeds]
        missed = [s for s in per if per[s]["misses"]]
        name = f"{workload}/{n}/{load}" + ("" if scale == "null" else f" x{scale}")
        if missed and len(missed) == len(per):
            everywhere.append(name)
        elif missed:
            somewhere.append(f"{name} (seed {', '.join(map(str, missed))})")
        ratio = geometric_mean([v["p99_ratio"] for v in per.values()])
        lines.append(f"| {workload} | {n} | {load} | {'-' if scale == 'null' else scale} | "
                     + " | ".join(cols)
                     + f" | {ratio:.3f} | {len(per) - len(missed)} of {len(per)} |")
    lines += ["", f"Cells judged: {len(verdicts)} on seeds {', '.join(map(str, seeds))}. "
              f"Missed on every seed: {len(everywhere)}"
              + (f" ({'; '.join(everywhere)})" if everywhere else "")
              + f". Missed on some seeds only: {len(somewhere)}"
              + (f" ({'; '.join(somewhere)})" if somewhere else "") + "."]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stores", nargs="+", type=Path, help="tournament.json files")
    parser.add_argument("--kind", choices=("router", "sensitivity", "trace"), default="router",
                        help="judge the router cells, the cost-sensitivity cells or trace cells")
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = parser.parse_args(argv)
    stores = [json.loads(p.read_text()) for p in args.stores]
    lines = report(seed_verdicts(cells_by_seed(stores, args.kind)))
    print("\n".join(lines))
    if args.out is not None:
        command = "python -m iterserve.loadtests.studies.router_tournament.tournament_seeds " + " ".join(
            sys.argv[1:] if argv is None else argv)
        head = ["# Tournament floors on several workload seeds", "", f"`{command}`", ""]
        args.out.write_text("\n".join(head + lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
