"""The tournament with KV pulls between replicas in the simulator: does pulling pay?

Every replica of the simulated cluster (Llama-3-8B on H100s, two ingress routers) has the KV
tiers of the tier cells (`kv_tiers.TIERS`: 64 GiB host, 512 GiB disk). With pulls on
(`ClusterSimConfig.kv_pulls`, sim/kv_pull.py) a replica routed a prompt that another replica
holds further on its device or in its host tier pulls those blocks over a **simulated**
network (latency + bytes / bandwidth; 128 KiB a token) when that beats prefilling them, and
iterserve's router credits each replica what a pull would save it (`IterserveRouter(kv_pulls=)`),
so an overloaded holder loses to a light replica plus a pull. Arms:

    iterserve            pulls off (the tier cells' iterserve)
    iterserve-pull       pulls on, the router pull-aware, at network_gb_s (1, 12.5, 25 GB/s)
    iterserve-pullblind  pulls on, the router blind to them: pulls only where it sends a
                         request away from its prefix anyway (at 12.5 GB/s)

Workloads: multi-turn (and multi-tenant) with the device KV cut to 2,048 blocks as in the
tier cells, and Mooncake's conversation trace at the default device KV. Every GPU and
network figure is simulated (cost model, tier and network assumptions), nothing measured.

    python -m iterserve.loadtests.studies.router_tournament.kv_pull --jobs 1 \\
        --trace conversation_trace.jsonl --out loadtests/studies/router_tournament/results/kv_pull.json

A trace cell holds ~7.5 GB (eight or 32 replicas' caches and tier indexes): on a 24 GiB
machine run the trace with --jobs 1 (the study README has the commands as run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.autoscale.sim.kv_pull import SimKVPulls
from iterserve.loadtests.studies.router_tournament.kv_tiers import (
    MOONCAKE_CAPACITY,
    MOONCAKE_KEY,
    SMALL_DEVICE_BLOCKS,
    TIERS,
)
from iterserve.loadtests.studies.router_tournament.tournament_cells import (
    NUM_INGRESS_ROUTERS,
    cell_requests,
    sim_config,
    summarise,
)

OFF, AWARE, BLIND = "iterserve", "iterserve-pull", "iterserve-pullblind"
ARMS = (OFF, AWARE, BLIND)
DEFAULT_GB_S = SimKVPulls().network_gb_s  # 12.5: a 100 Gb/s NIC
# Round-robin capacity, req/s per replica, at 2,048 device blocks without tiers: probed by
# kv_tiers.probe_small_capacity (results/kv_tiers.json "capacity").
SMALL_CAPACITY = {"multi-turn": 12.7, "multi-tenant": 1.9}
CELL_REQUESTS = 1000  # at least, over at least 20 virtual seconds


def routers_for(cell: dict[str, Any]) -> list[IterserveRouter]:
    pulls = SimKVPulls(network_gb_s=cell["network_gb_s"]) if cell["router"] == AWARE else None
    return [IterserveRouter(name=cell["router"], kv_pulls=pulls)
            for _ in range(NUM_INGRESS_ROUTERS)]


def cell_config(cell: dict[str, Any]) -> Any:  # noqa: ANN401 - a ClusterSimConfig
    extra = {k: cell[k] for k in ("num_blocks", "max_model_len") if cell.get(k) is not None}
    if cell["router"] != OFF:
        extra["kv_pulls"] = SimKVPulls(network_gb_s=cell["network_gb_s"])
    return dataclasses.replace(sim_config(None, cell["seed"]), kv_tiers=TIERS, **extra)


def run_pull_cell(cell: dict[str, Any]) -> dict[str, Any]:
    cpu = time.process_time()
    result = simulate(cell_requests(cell), routers_for(cell), cell["replicas"],
                      cell_config(cell))
    out = dict(cell, cpu_s=time.process_time() - cpu, **summarise(result, cell["seed"]))
    summary = result.summary()
    out["all_tier_hit_rate"] = summary.get("all_tier_hit_rate", result.prefix_hit_rate)
    out["kv_pulls"] = summary.get("kv_pulls", {})
    return out


def _arms(sweep: Sequence[float], full: bool) -> list[tuple[str, float | None]]:
    """(router, network GB/s) pairs: off, aware at the default, and where `full` the aware
    arm at every swept bandwidth and the blind arm."""
    arms: list[tuple[str, float | None]] = [(OFF, None), (AWARE, DEFAULT_GB_S)]
    if full:
        arms += [(AWARE, gb_s) for gb_s in sweep if gb_s != DEFAULT_GB_S]
        arms.append((BLIND, DEFAULT_GB_S))
    return arms


def build_cells(sizes: Sequence[int], load: float, seeds: Sequence[int], trace: Path | None,
                workloads: Sequence[str], sweep: Sequence[float]) -> list[dict[str, Any]]:
    """Off and aware (at the default bandwidth) on every seed; the sweep and the blind arm
    on the first seed only (the shared 2-core box's time)."""
    cells = []
    for workload in workloads:
        for n in sizes:
            rate = load * SMALL_CAPACITY[workload] * n
            for seed in seeds:
                for router, gb_s in _arms(sweep, full=seed == seeds[0]):
                    cells.append({"workload": workload, "replicas": n, "load": load,
                                  "rate": rate, "duration_s": max(20.0, CELL_REQUESTS / rate),
                                  "router": router, "network_gb_s": gb_s, "seed": seed,
                                  "num_blocks": SMALL_DEVICE_BLOCKS})
    if trace is not None:
        from iterserve.autoscale.sim.traces import read_trace

        requests = read_trace(trace, 512)
        span = max(r.arrival_time for r in requests)
        for n in sizes:
            speed = load * MOONCAKE_CAPACITY * n / (len(requests) / span)
            for seed in seeds:
                for router, gb_s in _arms(sweep, full=seed == seeds[0]):
                    cells.append({"workload": MOONCAKE_KEY, "trace": str(trace), "speed": speed,
                                  "hash_block_size": 512, "max_model_len": 131072,
                                  "replicas": n, "load": load,
                                  "rate": len(requests) / span * speed,
                                  "duration_s": span / speed, "router": router,
                                  "network_gb_s": gb_s, "seed": seed})
    return cells


def cell_key(cell: dict[str, Any]) -> str:
    return json.dumps([cell["workload"], cell["replicas"], cell["load"], cell["router"],
                       cell["network_gb_s"], cell["seed"]])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32],
                        help="replicas per cell")
    parser.add_argument("--load", type=float, default=0.8,
                        help="fraction of the round-robin capacity (no tiers) offered")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="the simulator's and the generators' seeds")
    parser.add_argument("--workloads", nargs="*", default=["multi-turn", "multi-tenant"],
                        choices=sorted(SMALL_CAPACITY), help="generated workloads to run")
    parser.add_argument("--sweep", type=float, nargs="+", default=[1.0, DEFAULT_GB_S, 25.0],
                        help="network GB/s of the pull-aware arm's sweep (simulated)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="Mooncake's conversation_trace.jsonl (sha256 b8cbb061a852...)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--out", type=Path, required=True, help="the JSON store (resumed)")
    args = parser.parse_args(argv)
    store = json.loads(args.out.read_text()) if args.out.exists() else {"cells": {}}
    cells = build_cells(args.sizes, args.load, args.seeds, args.trace, args.workloads,
                        args.sweep)
    todo = [c for c in cells if cell_key(c) not in store["cells"]]
    # off and aware at the default first (the cells' question), then the sweep and the blind
    # arm; the longest first within each
    todo.sort(key=lambda c: (c["router"] == BLIND or c["network_gb_s"] not in (None, DEFAULT_GB_S),
                             c["seed"], -c["duration_s"] * c["replicas"] * c["rate"]))
    t0 = time.time()
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        for i, result in enumerate(pool.imap_unordered(run_pull_cell, todo), 1):
            store["cells"][cell_key(result)] = result
            pulls = result["kv_pulls"]
            print(f"[{i}/{len(todo)} {time.time() - t0:5.0f}s] {result['workload']} "
                  f"n={result['replicas']} seed={result['seed']} {result['router']} "
                  f"{result['network_gb_s']}: p99 {result['ttft_p99_s'][0]:.3f}s pulls "
                  f"{pulls.get('taken', 0):.0f}/{pulls.get('failed', 0):.0f}", flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(store, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
