"""The tournament with KV tiers in the simulator: does a router that knows the tiers win?

Every replica of the simulated cluster (Llama-3-8B on H100s, two ingress routers) gets a
host KV tier and a disk tier below its device KV (`ClusterSimConfig.kv_tiers`; sizes and
bandwidths below, assumptions labelled as such). iterserve's router reads each replica's
per-tier answers and charges a prefix by where it lives (`RouterConfig.score_kv_tiers`:
device ~0, host ~copy, disk ~read, nowhere ~prefill); `iterserve-tierblind` is the same
router reading the device alone (what LMCache behind Ray's router does today: "the router
... scores an offloaded prefix as though it weren't cached"); the other baselines read the
device alone too, as their KV events do. `iterserve-notiers` is iterserve on the same
cluster without tiers (what the tiers buy); `iterserve-asyncstores` a what-if, iterserve with
the device -> host stores overlapping compute (SimKVTiers.charge_stores off), which
iterserve's engine does not do; `iterserve-arc` and `iterserve-slru` iterserve with the host
tier evicting by ARC or the segmented LRU instead of LRU (`kv_offloading_eviction_policy`).
Every GPU-side figure is simulated (the calibrated cost model plus the tiers' copy times),
not measured.

Each workload's `unbounded_hit_rate`: the prompt tokens a single cache that never evicts
and has seen every earlier request (prompt and answer, in arrival order) would serve, over
all prompt tokens: the reuse the workload offers at all, an upper bound for any router and
any cache size (it counts a prefix from a request still running as cached).

    python -m iterserve.loadtests.studies.router_tournament.kv_tiers --jobs 2 \\
        --trace conversation_trace.jsonl --out loadtests/studies/router_tournament/results/kv_tiers.json
    (the study's README has the commands as run, split by --only and --routers)
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

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.autoscale.sim.kv_tiers import SimKVTiers
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.loadtests.studies.router_tournament.tournament_cells import (
    NUM_INGRESS_ROUTERS,
    ROUTERS,
    _sustained,
    cell_requests,
    sim_config,
    summarise,
)
from iterserve.replica.block_keys import ROOT_HASH, block_hash, block_tokens, num_cacheable_blocks

# Per replica: 64 GiB of host memory (the engine's kv_offloading_size=auto cap) and 512 GiB
# of local NVMe; bandwidths are RouterConfig's assumptions (25 GB/s PCIe 4.0 x16 pinned,
# 6 GB/s one NVMe drive), the same numbers the router charges with.
TIERS = SimKVTiers(host_gib=64.0, disk_gib=512.0)
TIER_ROUTERS = ("iterserve", "iterserve-tierblind", "dynamo", "llm-d-precise", "sglang", "pow2")
NO_TIERS = "iterserve-notiers"
# What-if: iterserve with stores that overlap compute (SimKVTiers.charge_stores off)
ASYNC_STORES = "iterserve-asyncstores"
# iterserve with the host tier evicting by another kv_offloading_eviction_policy (lru: TIERS)
EVICTION_ARMS = {"iterserve-arc": "arc", "iterserve-slru": "slru"}
MOONCAKE_CAPACITY = 1.26875  # req/s per replica: results/traces (round-robin probe, no tiers)
MOONCAKE_KEY = "conversation_trace"
GENERATED = ("multi-turn", "multi-tenant")
# The generated workloads never overflow the default device KV (412k tokens a replica) in a
# tournament cell (their turns and tenants come back within seconds; checked: multi-turn at
# 8 replicas, 20 s, gives the same hits and TTFTs with and without tiers), so their cells
# run with this many blocks a replica (32,768 tokens, 4 GiB), at 0.8 of that cluster's own
# round-robin capacity: a device KV the working set overflows.
SMALL_DEVICE_BLOCKS = 2048
CELL_REQUESTS = 1000  # at least, over at least 20 virtual seconds

ROUTERS.setdefault("iterserve-tierblind", lambda: IterserveRouter(
    RouterConfig(score_kv_tiers=False), name="iterserve-tierblind"))
ROUTERS.setdefault(NO_TIERS, lambda: IterserveRouter(name=NO_TIERS))
ROUTERS.setdefault(ASYNC_STORES, lambda: IterserveRouter(name=ASYNC_STORES))
for _arm in EVICTION_ARMS:
    ROUTERS.setdefault(_arm, lambda name=_arm: IterserveRouter(name=name))


def unbounded_hit_rate(requests: Sequence[WorkloadRequest], block_size: int = 16) -> float:
    """Prompt tokens an unbounded cache would serve over all prompt tokens (module doc)."""
    seen: set[int] = set()
    hit = total = 0
    for request in sorted(requests, key=lambda r: r.arrival_time):
        prompt = list(request.prompt_token_ids)
        total += len(prompt)
        key, found = ROOT_HASH, True
        for i in range(num_cacheable_blocks(len(prompt), block_size)):
            key = block_hash(key, block_tokens(prompt[i * block_size:(i + 1) * block_size]))
            if found and key in seen:
                hit += block_size
            else:
                found = False
                seen.add(key)
        tokens = prompt + [request.output_token_id] * request.max_tokens
        for i in range(num_cacheable_blocks(len(prompt), block_size),
                       len(tokens) // block_size):
            key = block_hash(key, block_tokens(tokens[i * block_size:(i + 1) * block_size]))
            seen.add(key)
    return hit / total if total else 0.0


def cell_config(cell: dict[str, Any]) -> Any:  # noqa: ANN401 - a ClusterSimConfig
    config = sim_config(None, cell["seed"])
    extra = {k: cell[k] for k in ("num_blocks", "max_model_len") if cell.get(k) is not None}
    if cell["router"] == ASYNC_STORES:
        extra["kv_tiers"] = dataclasses.replace(TIERS, charge_stores=False)
    elif cell["router"] in EVICTION_ARMS:
        extra["kv_tiers"] = dataclasses.replace(TIERS, host_eviction=EVICTION_ARMS[cell["router"]])
    elif cell["router"] != NO_TIERS:
        extra["kv_tiers"] = TIERS
    return dataclasses.replace(config, **extra)


def run_tier_cell(cell: dict[str, Any]) -> dict[str, Any]:
    config = cell_config(cell)
    requests = cell_requests(cell)
    routers = [ROUTERS[cell["router"]]() for _ in range(NUM_INGRESS_ROUTERS)]
    cpu = time.process_time()
    result = simulate(requests, routers, cell["replicas"], config)
    out = dict(cell, cpu_s=time.process_time() - cpu, **summarise(result, cell["seed"]))
    summary = result.summary()
    out["all_tier_hit_rate"] = summary.get("all_tier_hit_rate", result.prefix_hit_rate)
    out["kv_tiers"] = summary.get("kv_tiers", {})
    return out


def probe_small_capacity(workload: str, seed: int = 1, duration_s: float = 30.0) -> float:
    """probe_capacity's rule (round-robin, completions >= 85 % of arrivals) on the cluster
    with the small device KV and no tiers."""
    from iterserve.autoscale.sim.shapes import make

    config = dataclasses.replace(sim_config(), num_blocks=SMALL_DEVICE_BLOCKS)
    rate = 16.0
    while True:
        done, arrivals = _sustained(make(workload, rate, duration_s, seed=seed), config,
                                    duration_s)
        if done < 0.85 * arrivals:
            return done / 8
        rate *= 2


def build_cells(sizes: Sequence[int], load: float, seeds: Sequence[int], trace: Path | None,
                caps: dict[str, float]) -> list[dict[str, Any]]:
    """Generated workloads on every seed; the trace (long cells) on the first seed only."""
    routers = (*TIER_ROUTERS, NO_TIERS, ASYNC_STORES, *EVICTION_ARMS)
    cells = []
    for workload in GENERATED:
        for n in sizes:
            rate = load * caps[f"{workload} small"] * n
            duration = max(20.0, CELL_REQUESTS / rate)
            for seed in seeds:
                for router in routers:
                    cells.append({"workload": workload, "replicas": n, "load": load,
                                  "rate": rate, "duration_s": duration, "router": router,
                                  "seed": seed, "num_blocks": SMALL_DEVICE_BLOCKS})
    seed = seeds[0]
    if trace is not None:
        from iterserve.autoscale.sim.traces import read_trace

        requests = read_trace(trace, 512)
        span = max(r.arrival_time for r in requests)
        for n in sizes:
            speed = load * MOONCAKE_CAPACITY * n / (len(requests) / span)
            for router in routers:
                cells.append({"workload": MOONCAKE_KEY, "trace": str(trace), "speed": speed,
                              "hash_block_size": 512, "max_model_len": 131072, "replicas": n,
                              "load": load, "rate": len(requests) / span * speed,
                              "duration_s": span / speed, "router": router, "seed": seed})
    return cells


def workload_key(cell: dict[str, Any]) -> str:
    """What fixes a cell's requests: the trace, or the generator at its rate and seed."""
    if "trace" in cell:
        return cell["workload"]
    return f"{cell['workload']} n={cell['replicas']} seed={cell['seed']}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32],
                        help="replicas per cell")
    parser.add_argument("--load", type=float, default=0.8,
                        help="fraction of the round-robin capacity (no tiers) offered")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                        help="the simulator's and the generators' seeds (the trace: the first)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="Mooncake's conversation_trace.jsonl (sha256 b8cbb061a852...)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--only", nargs="*", default=None,
                        help="run only these workloads (multi-turn, multi-tenant, "
                        "conversation_trace)")
    parser.add_argument("--routers", nargs="+", default=[*TIER_ROUTERS, NO_TIERS],
                        choices=[*TIER_ROUTERS, NO_TIERS, ASYNC_STORES, *EVICTION_ARMS],
                        help="run only these routers")
    parser.add_argument("--out", type=Path, required=True, help="the JSON store (resumed)")
    args = parser.parse_args(argv)
    store = json.loads(args.out.read_text()) if args.out.exists() else {
        "cells": {}, "capacity": {}, "unbounded_hit_rate": {}}
    caps = store["capacity"]
    for workload in GENERATED:
        if f"{workload} small" not in caps:
            caps[f"{workload} small"] = probe_small_capacity(workload)
            print(f"capacity {workload} at {SMALL_DEVICE_BLOCKS} blocks: "
                  f"{caps[f'{workload} small']:.2f} req/s per replica", flush=True)
    cells = build_cells(args.sizes, args.load, args.seeds, args.trace, caps)
    cells = [c for c in cells if c["router"] in args.routers
             and (not args.only or c["workload"] in args.only)]
    for cell in cells:
        name = workload_key(cell)
        if name not in store["unbounded_hit_rate"]:
            rate = unbounded_hit_rate(cell_requests(dict(cell, speed=1.0)
                                                    if "trace" in cell else cell))
            store["unbounded_hit_rate"][name] = rate
            print(f"unbounded hit rate {name}: {rate:.3f}", flush=True)
    key = lambda c: json.dumps([c["workload"], c["replicas"], c["load"], c["router"],  # noqa: E731
                                c["seed"], c.get("num_blocks")])
    todo = [c for c in cells if key(c) not in store["cells"]]
    todo.sort(key=lambda c: -c["duration_s"] * c["replicas"] * c["rate"])
    t0 = time.time()
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        for i, result in enumerate(pool.imap_unordered(run_tier_cell, todo), 1):
            store["cells"][key(result)] = result
            print(f"[{i}/{len(todo)} {time.time() - t0:5.0f}s] {result['workload']} "
                  f"n={result['replicas']} blocks={result.get('num_blocks')} "
                  f"{result['router']}: p99 {result['ttft_p99_s'][0]:.3f}s hit "
                  f"{result['prefix_hit_rate']:.2f}/{result['all_tier_hit_rate']:.2f}", flush=True)
            args.out.write_text(json.dumps(store, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
