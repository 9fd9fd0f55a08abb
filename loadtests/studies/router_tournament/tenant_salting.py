"""The multi-tenant tournament cells with tenant cache salting off and on (issue 42).

    python -m iterserve.loadtests.studies.router_tournament.tenant_salting [--jobs 2] \
        [--sizes 8] [--loads 0.5 0.8 0.95] [--routers ...]

Each cell of the tournament's multi-tenant workload (its rate from the stored capacity
probe, results/tournament.json) runs twice in this one command, with the workload as
generated (every tenant in the shared cache namespace: the tournament's published cells)
and salted by tenant (`sim/tenant_salt.py`: what the ingress does by default since
tenants), so the two columns compare on the same code. Writes
results/tenant_salting.json and .md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iterserve.loadtests.studies import results_of
from iterserve.loadtests.studies.router_tournament.tournament import LOADS, router_cells
from iterserve.loadtests.studies.router_tournament.tournament_cells import ROUTERS, run_cell

WORKLOAD = "multi-tenant"
# The tournament's published contestants (its README's commands).
PUBLISHED_ROUTERS = ("pow2", "least-kv", "llm-d", "llm-d-precise", "dynamo", "ray-prefix",
                     "sglang", "iterserve")


def cells_both_ways(sizes: Sequence[int], loads: Sequence[float], routers: Sequence[str],
                    capacity: float) -> list[dict[str, Any]]:
    plain = router_cells([WORKLOAD], sizes, loads, routers, {WORKLOAD: capacity}, seed=0)
    return [{**cell, "tenant_cache_isolation": salted} for cell in plain
            for salted in (False, True)]


def table(results: list[dict[str, Any]]) -> str:
    """One row per (size, load, router): p50 / p99 TTFT and prefix-cache hit rate, off and
    on, and whether the on cell's figures equal the off cell's."""
    by_key = {(r["replicas"], r["load"], r["router"], r["tenant_cache_isolation"]): r
              for r in results}
    lines = ["| replicas | load | router | p99 TTFT off / on (s) | p50 TTFT off / on (s) | "
             "hit rate off / on | identical |", "|---|---|---|---|---|---|---|"]
    for (n, load, router, salted), off in sorted(by_key.items()):
        if salted:
            continue
        on = by_key[(n, load, router, True)]
        same = all(off[k] == on[k] for k in ("ttft_p50_s", "ttft_p99_s", "prefix_hit_rate",
                                               "throughput_tok_s", "preemptions"))
        lines.append(f"| {n} | {load} | {router} | {off['ttft_p99_s'][0]:.3f} / "
                     f"{on['ttft_p99_s'][0]:.3f} | {off['ttft_p50_s'][0]:.3f} / "
                     f"{on['ttft_p50_s'][0]:.3f} | {off['prefix_hit_rate']:.4f} / "
                     f"{on['prefix_hit_rate']:.4f} | {'yes' if same else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="cells simulated in parallel")
    parser.add_argument("--sizes", nargs="*", type=int, default=[8], help="replica counts")
    parser.add_argument("--loads", nargs="*", type=float, default=list(LOADS),
                        help="fractions of the probed capacity")
    parser.add_argument("--routers", nargs="*", choices=list(ROUTERS),
                        default=list(PUBLISHED_ROUTERS), help="routers to run")
    parser.add_argument("--out", type=Path, default=results_of("router_tournament"),
                        help="folder of tournament.json and the outputs")
    args = parser.parse_args(argv)
    store = json.loads((args.out / "tournament.json").read_text())
    capacity = store["capacity"][json.dumps([WORKLOAD, None])]
    cells = cells_both_ways(args.sizes, args.loads, args.routers, capacity)
    with multiprocessing.Pool(args.jobs) as pool:
        results = pool.map(run_cell, cells)
    (args.out / "tenant_salting.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (args.out / "tenant_salting.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
