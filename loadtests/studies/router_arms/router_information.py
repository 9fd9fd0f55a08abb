"""How much of a router's tail comes from what it cannot see: one tournament cell rerun with
fewer ingress routers, fresher routing stats, or routers that tell each other their sends.

    python -m iterserve.loadtests.studies.router_arms.router_information --workload multi-tenant \
        --replicas 8 \
        --load 0.5 [--cost-scale '{"*": 2.0}'] [--seeds 0 1 2] [--router iterserve] \
        [--variants 2:0.5 1:0.5 2:0.05 1:0.01 2:0.5:0.01]

The tournament runs NUM_INGRESS_ROUTERS independent routers (one per ingress replica; none
sees the others' sends) on stats `routing_stats_period_s` old. A variant "R:P" runs R routers
on stats P seconds old: "1:0.01" is one router that sees every send and nearly fresh
replica state, about the best information a router can have. "R:P:S" adds router sync:
each router hears of the others' sends and completions S seconds after them (Dynamo's
`router_replica_sync`; `ClusterSimConfig.router_sync_delay_s`), what "1:P" would be worth
with R ingress routers kept. The cell's rate and duration
are the tournament's (capacity from the tournament store's cache, else probed), so the
"2:0.5" row reproduces the tournament cell. pow2 (the tournament's setting) is run beside
it: where even "1:0.01" is above pow2 / 2, a floor of "2x better than pow2" cannot be met
by better information, only by a different policy.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iterserve.loadtests.studies import results_of
from iterserve.loadtests.studies.router_tournament.tournament import capacities, cell_duration_s
from iterserve.loadtests.studies.router_tournament.tournament_cells import (
    NUM_INGRESS_ROUTERS,
    ROUTERS,
    run_cell,
)

# ingress routers, routing stats period (s), router sync delay (s; None: no sync)
Variant = tuple[int, float, float | None]


def parse_variant(text: str) -> Variant:
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"variant {text!r}: ROUTERS:STATS_PERIOD[:SYNC_DELAY]")
    routers, period = int(parts[0]), float(parts[1])
    sync = float(parts[2]) if len(parts) == 3 else None
    if routers < 1 or period <= 0 or (sync is not None and sync < 0):
        raise ValueError(f"variant {text!r}: routers >= 1, a positive stats period and a "
                         "sync delay >= 0")
    return routers, period, sync


def label(router: str, variant: Variant) -> str:
    routers, period, sync = variant
    text = f"{router}, {routers} : {period} s"
    return text if sync is None else f"{text}, sync {sync} s"


def run_variant(workload: str, replicas: int, rate: float, duration_s: float, seed: int,
                router: str, variant: Variant, cost_scale: dict[str, float] | None
                ) -> dict[str, Any]:
    """The tournament cell's summary (tournament_cells.run_cell) with `variant`'s routers
    and stats."""
    num_routers, period, sync = variant
    cell = {"workload": workload, "replicas": replicas, "rate": rate, "duration_s": duration_s,
            "router": router, "seed": seed, "cost_scale": cost_scale,
            "ingress_routers": num_routers, "routing_stats_period_s": period}
    if sync is not None:
        cell["router_sync_delay_s"] = sync
    return run_cell(cell)


def table(rows: dict[str, dict[int, float]], seeds: Sequence[int]) -> list[str]:
    lines = ["| routers : stats period | " + " | ".join(f"seed {s} p99 TTFT (s)" for s in seeds)
             + " |", "|---|" + "---|" * len(seeds)]
    for name, per_seed in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{per_seed[s]:.3f}" for s in seeds) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, help="the tournament workload of the cell")
    parser.add_argument("--replicas", type=int, default=8, help="the cell's replicas")
    parser.add_argument("--load", type=float, required=True,
                        help="the cell's load (fraction of capacity)")
    parser.add_argument("--cost-scale", type=json.loads, default=None,
                        help="JSON cost factors of a sensitivity cell, e.g. '{\"*\": 2.0}'")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="workload and simulator seeds")
    parser.add_argument("--router", default="iterserve", choices=sorted(ROUTERS),
                        help="the router every ingress runs")
    parser.add_argument("--variants", type=parse_variant, nargs="+",
                        default=[(NUM_INGRESS_ROUTERS, 0.5, None), (1, 0.5, None),
                                 (2, 0.05, None), (1, 0.01, None),
                                 (NUM_INGRESS_ROUTERS, 0.5, 0.01)],
                        help="ROUTERS:STATS_PERIOD[:SYNC_DELAY] each: ingress routers, seconds "
                             "between routing stats, router sync delay")
    parser.add_argument("--store", type=Path, default=results_of("router_tournament") / "tournament.json",
                        help="tournament store whose capacity cache sets the rate")
    args = parser.parse_args(argv)
    cache = json.loads(args.store.read_text()).get("capacity", {}) if args.store.exists() else {}
    capacity = capacities([args.workload], args.cost_scale, cache)[args.workload]
    rate = args.load * capacity * args.replicas
    duration = cell_duration_s(args.replicas, rate)
    print(f"{args.workload}, {args.replicas} replicas, load {args.load}, cost scale "
          f"{args.cost_scale}: {rate:.2f} req/s for {duration:.1f} virtual s", flush=True)
    tournament = (NUM_INGRESS_ROUTERS, 0.5, None)
    rows: dict[str, dict[int, float]] = {}
    for seed in args.seeds:
        pow2 = run_variant(args.workload, args.replicas, rate, duration, seed, "pow2",
                           tournament, args.cost_scale)["ttft_p99_s"][0]
        rows.setdefault(label("pow2", tournament), {})[seed] = pow2
        rows.setdefault("pow2 / 2", {})[seed] = pow2 / 2
        for variant in args.variants:
            p99 = run_variant(args.workload, args.replicas, rate, duration, seed, args.router,
                              variant, args.cost_scale)["ttft_p99_s"][0]
            rows.setdefault(label(args.router, variant), {})[seed] = p99
            print(f"seed {seed} {args.router} {variant}: p99 {p99:.3f} s "
                  f"(pow2 / ours {pow2 / p99:.2f}x)", flush=True)
    print("\n".join(table(rows, args.seeds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
