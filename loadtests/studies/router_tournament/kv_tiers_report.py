"""The KV-tier tournament's tables (`kv_tiers.py`'s JSON store -> markdown).

    python -m iterserve.loadtests.studies.router_tournament.kv_tiers_report STORE.json > OUT.md

Per workload and size: the unbounded cache's hit rate, then per router the p50 / p99 TTFT
(mean over the seeds run, with the seeds' min-max), the device hit rate and the hit rate
counting every tier, and the tiers' copy seconds (all simulated); and per seed, iterserve's
p99 over the tier-blind arm's and over the best other router's.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _spread(values: Sequence[float], digits: int = 3) -> str:
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def report(store: dict[str, Any]) -> str:
    groups: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list))
    for cell in store["cells"].values():
        groups[(cell["workload"], cell["replicas"])][cell["router"]].append(cell)
    unbounded = store["unbounded_hit_rate"]
    lines = []
    for (workload, n), by_router in sorted(groups.items()):
        any_cell = next(iter(by_router.values()))[0]
        seeds = sorted({c["seed"] for cells in by_router.values() for c in cells})
        bound = [unbounded.get(workload) or unbounded.get(
            f"{workload} n={n} seed={s}") for s in seeds]
        blocks = any_cell.get("num_blocks") or "default (412k tokens)"
        lines += [f"### {workload}, {n} replicas (load {any_cell['load']}, "
                  f"{any_cell['requests']} requests, seeds {seeds}, device KV {blocks} "
                  f"blocks a replica)", "",
                  f"Unbounded cache's hit rate: {_spread([b for b in bound if b is not None])}",
                  "", "| router | p50 TTFT s | p99 TTFT s | device hit | all-tier hit | "
                  "copy s (sim) |", "|---|---|---|---|---|---|"]
        order = sorted(by_router, key=lambda r: sum(c["ttft_p99_s"][0] for c in by_router[r])
                       / len(by_router[r]))
        for router in order:
            cells = by_router[router]
            lines.append(
                f"| {router} | {_spread([c['ttft_p50_s'][0] for c in cells])} | "
                f"{_spread([c['ttft_p99_s'][0] for c in cells])} | "
                f"{_spread([c['prefix_hit_rate'] for c in cells], 2)} | "
                f"{_spread([c['all_tier_hit_rate'] for c in cells], 2)} | "
                f"{_spread([c['kv_tiers'].get('copy_seconds', 0.0) for c in cells], 1)} |")
        ratios = []
        for seed in seeds:
            p99 = {r: c["ttft_p99_s"][0] for r, cells in by_router.items()
                   for c in cells if c["seed"] == seed}
            if "iterserve" in p99 and "iterserve-tierblind" in p99:
                others = {r: v for r, v in p99.items() if not r.startswith("iterserve")}
                best = min(others, key=others.get) if others else None
                ratios.append(f"seed {seed}: iterserve / tier-blind p99 "
                              f"{p99['iterserve'] / p99['iterserve-tierblind']:.3f}"
                              + (f", / best other ({best}) {p99['iterserve'] / others[best]:.3f}"
                                 if best else ""))
        lines += ["", "; ".join(ratios), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(report(json.loads(Path(args[0]).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
