"""The tournament's LoRA adapter cells (issue 44): adapter-aware routing against Ray Serve's
multiplexing and random, on replicas that hold adapters and pay to load them.

    python -m iterserve.loadtests.studies.router_tournament.lora_adapters [--jobs 2] \
        [--sizes 8 32] [--loads 0.8] [--seeds 0 1] [--variants steady reversed]

The outputs are rewritten after every cell (a stopped run keeps what it finished), with the
cells of the first router named run first.

Workload: the tournament's "steady" shape at a fraction of its probed capacity (stored in
results/tournament.json, base model: adapters make a replica slower, so a load here is of
the base model's capacity), every request naming one of --num-adapters adapters of Zipf
popularity (--zipf-a; sim/lora_workload.py). Variant "reversed": from half the run on, the
ranks reverse, so the hottest adapter is one the replicas placed while it was cold.
Replicas (sim/lora.py): --max-loras device slots, --max-cpu-loras host LRU, the engine's
admission rule (at most max_loras distinct adapters running), simulated load costs
(SimLoRA's defaults: 84 MB adapters, 25 GB/s host-to-device, 2 GB/s disk).
Contestants: iterserve (the real router with lora_affinity_slack), iterserve without lora
affinity, iterserve with wider slacks, Ray Serve's multiplexing (baseline_lora_routers.py),
random. Per cell: p50/p99 TTFT (bootstrap 95 % intervals), throughput, adapter loads (host
and disk), the loads by cause (`load_causes`), and how many replicas served the hottest
adapter (over the second half of the run, past the warm-up and, in "reversed", after the
turn). Writes results/<--stem>.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.sim.baseline_lora_routers import RayMultiplexRouter
from iterserve.autoscale.sim.baseline_routers import RandomRouter
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.autoscale.sim.lora import SimLoRA
from iterserve.autoscale.sim.lora_workload import adapter_name, with_zipf_adapters
from iterserve.autoscale.sim.routing_context import RoutingPolicy
from iterserve.autoscale.sim.shapes import make
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.loadtests.studies import results_of
from iterserve.loadtests.studies.router_tournament.tournament import cell_duration_s
from iterserve.loadtests.studies.router_tournament.tournament_cells import (
    NUM_INGRESS_ROUTERS,
    sim_config,
    summarise,
)

WORKLOAD = "steady"
VARIANTS = ("steady", "reversed")


def _iterserve_with_slack(slack: float) -> Callable[[], RoutingPolicy]:
    return lambda: IterserveRouter(RouterConfig(lora_affinity_slack=slack),
                                   name=f"iterserve-slack{slack:g}")


LORA_ROUTERS: dict[str, Callable[[], RoutingPolicy]] = {
    "iterserve": IterserveRouter,
    "iterserve-nolora": lambda: IterserveRouter(name="iterserve-nolora", lora_affinity=False),
    "iterserve-slack4": _iterserve_with_slack(4.0),
    "iterserve-slack16": _iterserve_with_slack(16.0),
    "ray-multiplex": RayMultiplexRouter,
    "random": RandomRouter,
}


def lora_cells(sizes: Sequence[int], loads: Sequence[float], seeds: Sequence[int],
               variants: Sequence[str], routers: Sequence[str], capacity: float,
               adapters: dict[str, Any]) -> list[dict[str, Any]]:
    cells = []
    for variant in variants:
        for n in sizes:
            for load in loads:
                rate = load * capacity * n
                duration = cell_duration_s(n, rate)
                for seed in seeds:
                    for router in routers:
                        cells.append({"kind": "lora", "workload": WORKLOAD, "variant": variant,
                                      "replicas": n, "load": load, "rate": rate,
                                      "duration_s": duration, "router": router,
                                      "seed": seed, **adapters})
    return cells


def hottest_adapter(cell: dict[str, Any]) -> str:
    """The adapter with the most traffic over the second half of the run."""
    rank = cell["num_adapters"] if cell["variant"] == "reversed" else 1
    return adapter_name(rank)


def hot_adapters(requests: Sequence[WorkloadRequest], replicas: int, half: float
                 ) -> frozenset[str]:
    """The adapters with more than one replica's share of the traffic in either half of
    the run: those a router may have to spread."""
    hot: set[str] = set()
    for in_half in (lambda t: t < half, lambda t: t >= half):
        named = Counter(r.adapter for r in requests
                        if r.adapter is not None and in_half(r.arrival_time))
        total = sum(named.values())
        hot.update(a for a, n in named.items() if n * replicas > total)
    return frozenset(hot)


def load_causes(loads: dict[str, int], readers: dict[str, int], hot: frozenset[str]
                ) -> dict[str, int]:
    """The cell's adapter loads by cause (they sum to its loads): each adapter's first
    read in the cluster; a further replica's first read of a hot adapter (spreading it) or
    of a cold one (landing where it is not held while another replica holds it); a re-read
    from disk after a replica's host LRU dropped it; a copy from host after its device slot
    was taken."""
    return {"first": len(readers),
            "spread_hot": sum(n - 1 for a, n in readers.items() if a in hot),
            "spread_cold": sum(n - 1 for a, n in readers.items() if a not in hot),
            "host_lru_reread": loads["from_disk"] - sum(readers.values()),
            "slot_reload": loads["from_host"]}


def run_lora_cell(cell: dict[str, Any]) -> dict[str, Any]:
    half = cell["duration_s"] / 2
    requests = with_zipf_adapters(
        make(WORKLOAD, cell["rate"], cell["duration_s"], cell["seed"]), cell["num_adapters"],
        cell["zipf_a"], cell["base_fraction"], cell["seed"],
        reversed_from_s=half if cell["variant"] == "reversed" else None)
    lora = SimLoRA(max_loras=cell["max_loras"], max_cpu_loras=cell["max_cpu_loras"])
    config = dataclasses.replace(sim_config(None, cell["seed"]), lora=lora)
    routers = [LORA_ROUTERS[cell["router"]]() for _ in range(NUM_INGRESS_ROUTERS)]
    cpu = time.process_time()
    result = simulate(requests, routers, cell["replicas"], config)
    adapter_of = {r.request_id: r.adapter for r in requests}
    hot = hottest_adapter(cell)
    hot_replicas = {r.replica for r in result.records
                    if adapter_of[r.request_id] == hot and r.arrival >= half}
    return {**cell, "cpu_s": time.process_time() - cpu, **summarise(result, cell["seed"]),
            "adapter_loads": result.adapter_loads,
            "adapter_loads_total": sum(result.adapter_loads.values()),
            "load_causes": load_causes(result.adapter_loads, result.adapter_readers,
                                       hot_adapters(requests, cell["replicas"], half)),
            "hot_adapter": hot, "hot_adapter_replicas": len(hot_replicas)}


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| variant | replicas | load | seed | router | p50 TTFT (s) | p99 TTFT (s) [95 % CI] "
             "| throughput (tok/s) | adapter loads host / disk | loads by cause: first / "
             "spread hot / spread cold / host re-read / slot reload | "
             "replicas serving the hottest |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["variant"], r["replicas"], r["load"], r["seed"],
                                            r["router"])):
        p99 = r["ttft_p99_s"]
        lines.append(f"| {r['variant']} | {r['replicas']} | {r['load']} | {r['seed']} | "
                     f"{r['router']} | {r['ttft_p50_s'][0]:.3f} | {p99[0]:.3f} "
                     f"[{p99[1]:.3f}, {p99[2]:.3f}] | {r['throughput_tok_s']:.0f} | "
                     f"{r['adapter_loads']['from_host']} / {r['adapter_loads']['from_disk']} | "
                     f"{_causes(r)} | {r['hot_adapter_replicas']} |")
    return "\n".join(lines) + "\n" + measure_lines(results)


def _causes(result: dict[str, Any]) -> str:
    causes = result.get("load_causes")  # absent in the stores of earlier runs
    if causes is None:
        return "-"
    return " / ".join(str(causes[k]) for k in ("first", "spread_hot", "spread_cold",
                                                 "host_lru_reread", "slot_reload"))


def measure_lines(results: list[dict[str, Any]]) -> str:
    """Issue 44's measure per (variant, size, load, seed): iterserve's p99 TTFT no worse
    than ray-multiplex's and its adapter loads fewer."""
    by_key = {(r["variant"], r["replicas"], r["load"], r["seed"], r["router"]): r
              for r in results}
    lines = ["", "| variant | replicas | load | seed | iterserve p99 <= ray-multiplex p99 | "
             "iterserve loads < ray-multiplex loads |", "|---|---|---|---|---|---|"]
    for (variant, n, load, seed, router), ours in sorted(by_key.items()):
        ray = by_key.get((variant, n, load, seed, "ray-multiplex"))
        if router != "iterserve" or ray is None:
            continue
        faster = ours["ttft_p99_s"][0] <= ray["ttft_p99_s"][0]
        fewer = ours["adapter_loads_total"] < ray["adapter_loads_total"]
        lines.append(f"| {variant} | {n} | {load} | {seed} | {'yes' if faster else 'NO'} "
                     f"({ours['ttft_p99_s'][0]:.3f} vs {ray['ttft_p99_s'][0]:.3f}) | "
                     f"{'yes' if fewer else 'NO'} ({ours['adapter_loads_total']} vs "
                     f"{ray['adapter_loads_total']}) |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="cells simulated in parallel")
    parser.add_argument("--sizes", nargs="*", type=int, default=[8, 32], help="replica counts")
    parser.add_argument("--loads", nargs="*", type=float, default=[0.8],
                        help="fractions of the base model's probed capacity")
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1], help="workload seeds")
    parser.add_argument("--variants", nargs="*", choices=VARIANTS, default=list(VARIANTS),
                        help="steady Zipf ranks, or reversed at half time")
    parser.add_argument("--routers", nargs="*", choices=list(LORA_ROUTERS),
                        default=list(LORA_ROUTERS), help="contestants")
    parser.add_argument("--num-adapters", type=int, default=100, help="adapters in the workload")
    parser.add_argument("--zipf-a", type=float, default=1.0, help="Zipf exponent of popularity")
    parser.add_argument("--base-fraction", type=float, default=0.0,
                        help="fraction of requests for the base model")
    parser.add_argument("--max-loras", type=int, default=16, help="device adapter slots")
    parser.add_argument("--max-cpu-loras", type=int, default=32, help="host adapter LRU size")
    parser.add_argument("--out", type=Path, default=results_of("router_tournament"),
                        help="folder of tournament.json and the outputs")
    parser.add_argument("--stem", default="lora_adapters",
                        help="the outputs' file name before .json / .md (keeps earlier runs)")
    args = parser.parse_args(argv)
    store = json.loads((args.out / "tournament.json").read_text())
    capacity = store["capacity"][json.dumps([WORKLOAD, None])]
    adapters = {"num_adapters": args.num_adapters, "zipf_a": args.zipf_a,
                "base_fraction": args.base_fraction, "max_loras": args.max_loras,
                "max_cpu_loras": args.max_cpu_loras}
    cells = lora_cells(args.sizes, args.loads, args.seeds, args.variants, args.routers,
                       capacity, adapters)
    cells.sort(key=lambda c: args.routers.index(c["router"]))  # the first named run first
    results: list[dict[str, Any]] = []
    with multiprocessing.Pool(args.jobs) as pool:
        # Stored after every cell: a run stopped part way keeps the cells it finished.
        for result in pool.imap_unordered(run_lora_cell, cells):
            results.append(result)
            _store(results, args.out, args.stem)
            print(f"{len(results)}/{len(cells)} cells: {result['variant']} "
                  f"{result['replicas']} {result['load']} seed {result['seed']} "
                  f"{result['router']}", flush=True)
    print(table(results))
    return 0


def _store(results: list[dict[str, Any]], out: Path, stem: str) -> None:
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    (out / f"{stem}.md").write_text(table(results))


if __name__ == "__main__":
    raise SystemExit(main())
