"""Fair sharing between tenants in the simulated cluster (issue 43): who waits when it is full?

    python -m iterserve.loadtests.studies.router_tournament.tenant_fairness [--jobs 2] \\
        [--sizes 8 32 128] [--seeds 0 1 2] [--duration-s 20]

Every cell runs iterserve's router (two ingress routers) over simulated replicas
(Llama-3-8B on H100s: every GPU figure is the cost model's, nothing measured) whose waiting
queues the engine's own policy objects order (`ClusterSimConfig.tenancy`, sim/tenancy.py).
Arms:

    fcfs          today: arrival order in every replica
    priority      the engine's priority policy with the light tenant (noisy) or the
                  heaviest weight (backlogged) in the more important band
    fair          the engine's `fair`: VTC between tenants, prefill shares (per replica)
    fair+slo      fair, and each replica refuses at once a request predicted to miss its
                  tenant's 2 s TTFT objective (replica/slo_admission.py)
    flow-control  llm-d-style: fcfs engines, requests held at the gateway while the pool
                  is saturated, released by band, VTC between flows, FCFS in a flow
    ingress-fair  one admission queue at the ingress (autoscale/ingress_queue.py): fcfs
                  engines, requests held while no replica has a free place in its batch
                  (in flight < max_num_seqs, KV < 0.9: autoscale/ingress_saturation.py;
                  Serve's max_ongoing_requests at the same bound), released by band, then
                  cluster-wide VTC counters, then arrival

Workloads (sim/tenant_workloads.py; rates in units of the steady shape's probed capacity,
`STEADY_CAPACITY`, requests/s per replica; every tenant's TTFT objective 2 s):

    noisy         b at 1.5/11 of capacity, a at 10x b: together 1.5x capacity
    noisy-base    the same b, a at its equal-weight fair share (half the capacity)
    equal-weights three tenants, weights 1:1:1, at 0.5x, 1x and 2x capacity (each above
                  its third: backlogged; arrival order would serve them 1:2:4)
    weighted      three tenants, weights 1:2:4, each at 1.0x capacity (backlogged;
                  arrival order would serve them 1:1:1)
    solo          one tenant alone at 1.5x capacity (work conservation)

Writes results/tenant_fairness.json (every cell with its per-tenant figures) and .md (the
report: tenant_fairness_report.py), or --stem's names instead.
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

from iterserve.autoscale.ingress_saturation import IngressSaturation
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.autoscale.sim.tenancy import GatewaySaturation, SimTenancy, SimTenant
from iterserve.autoscale.sim.tenant_workloads import (
    backlogged,
    backlogged_tenants,
    noisy_neighbour,
    tenant_requests,
)
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.loadtests.studies import results_of
from iterserve.loadtests.studies.router_tournament.tenant_fairness_report import (
    report,
    tenant_figures,
)
from iterserve.loadtests.studies.router_tournament.tournament_cells import (
    NUM_INGRESS_ROUTERS,
    TTFT_SLO_S,
    sim_config,
)

# The steady shape's capacity, requests/s per replica (results/tournament.json "capacity",
# the round-robin probe); the tenants' requests have that shape.
STEADY_CAPACITY = 20.33125
OVERLOAD = 1.5  # the noisy run and the solo run: offered load over capacity
BACKLOGGED_RATE = 1.0  # each backlogged tenant's rate, in capacities (three: 3x)
TAIL_S = 10.0  # a backlogged run goes on this long past its arrivals (see run_fairness_cell)
ARMS = ("fcfs", "priority", "fair", "fair+slo", "flow-control", "ingress-fair")
WORKLOADS = ("noisy", "noisy-base", "equal-weights", "weighted", "solo")
UNEVEN_RATES = (0.5, 1.0, 2.0)  # equal-weights: each tenant's rate, in capacities


def cell_tenants(workload: str) -> tuple[SimTenant, ...]:
    """The workload's tenants (weights, band 0, the 2 s objective)."""
    if workload in ("noisy", "noisy-base"):
        names, weights = ("a", "b"), (1.0, 1.0)
    elif workload == "solo":
        names, weights = ("solo",), (1.0,)
    else:
        tenants = backlogged_tenants((1.0, 1.0, 1.0) if workload == "equal-weights"
                                     else (1.0, 2.0, 4.0))
        names, weights = tuple(t.name for t in tenants), tuple(t.weight for t in tenants)
    return tuple(SimTenant(n, w, 0, TTFT_SLO_S) for n, w in zip(names, weights, strict=True))


def arm_tenancy(arm: str, tenants: tuple[SimTenant, ...], max_num_seqs: int = 256
                ) -> SimTenancy:
    if arm == "fcfs":
        return SimTenancy(tenants, "fcfs")
    if arm == "priority":  # the light tenant ("b"), else the heaviest weight, goes first
        first = "b" if any(t.name == "b" for t in tenants) else max(
            tenants, key=lambda t: t.weight).name
        return SimTenancy(tuple(dataclasses.replace(t, priority=0 if t.name == first else 1)
                                for t in tenants), "priority")
    if arm == "fair":
        return SimTenancy(tenants, "fair")
    if arm == "fair+slo":
        return SimTenancy(tenants, "fair", slo_admission=True)
    if arm == "flow-control":
        return SimTenancy(tenants, "fcfs", gateway=GatewaySaturation())
    if arm == "ingress-fair":
        return SimTenancy(tenants, "fcfs", ingress=IngressSaturation(max_num_seqs))
    raise ValueError(f"unknown arm {arm!r}; choose one of {', '.join(ARMS)}")


def cell_requests(cell: dict[str, Any]) -> list[WorkloadRequest]:
    capacity = STEADY_CAPACITY * cell["replicas"]
    workload, duration, seed = cell["workload"], cell["duration_s"], cell["seed"]
    b_rate = OVERLOAD * capacity / 11
    if workload == "noisy":
        return noisy_neighbour(b_rate, 10 * b_rate, duration, seed)
    if workload == "noisy-base":
        return noisy_neighbour(b_rate, capacity / 2, duration, seed)
    if workload == "solo":
        return tenant_requests("solo", OVERLOAD * capacity, duration, seed, 0)
    if workload == "equal-weights":
        return backlogged(cell_tenants(workload), [r * capacity for r in UNEVEN_RATES],
                          duration, seed)
    tenants = cell_tenants(workload)
    return backlogged(tenants, [BACKLOGGED_RATE * capacity] * len(tenants), duration, seed)


def run_fairness_cell(cell: dict[str, Any]) -> dict[str, Any]:
    """One cell: its requests through the arm's cluster; the per-tenant figures. Backlogged
    and solo runs stop TAIL_S after the arrivals' end (their queues never drain; the tail
    lets the requests running at the window's end finish, so their tokens in it count);
    the noisy ones run until every request is answered."""
    requests = cell_requests(cell)
    base = sim_config(None, cell["seed"])
    tenancy = arm_tenancy(cell["arm"], cell_tenants(cell["workload"]), base.max_num_seqs)
    backlogged_run = cell["workload"] in ("equal-weights", "weighted", "solo")
    # the ingress arm: Serve offers the router only the replicas under the ingress's bound
    in_flight = base.max_ongoing_requests if tenancy.ingress is None \
        else tenancy.ingress.max_in_flight
    config = dataclasses.replace(base, tenancy=tenancy, max_ongoing_requests=in_flight,
                                 max_virtual_s=cell["duration_s"] + TAIL_S if backlogged_run
                                 else 1e9)
    routers = [IterserveRouter() for _ in range(NUM_INGRESS_ROUTERS)]
    cpu = time.process_time()
    result = simulate(requests, routers, cell["replicas"], config)
    return {**cell, "cpu_s": round(time.process_time() - cpu, 2),
            **tenant_figures(result.records, requests, tenancy, cell["duration_s"])}


def fairness_cells(sizes: Sequence[int], seeds: Sequence[int], duration_s: float,
                   arms: Sequence[str] = ARMS, workloads: Sequence[str] = WORKLOADS
                   ) -> list[dict[str, Any]]:
    cells = []
    for replicas in sizes:
        for seed in seeds:
            for workload in workloads:
                for arm in arms:
                    if workload == "solo" and arm not in ("fcfs", "fair", "ingress-fair"):
                        continue  # one tenant: the other arms have no one to share with
                    if workload == "equal-weights" and arm == "priority":
                        continue  # equal weights: one band, the fcfs arm's order
                    cells.append({"workload": workload, "arm": arm, "replicas": replicas,
                                  "seed": seed, "duration_s": duration_s,
                                  "router": "iterserve"})
    return cells


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="cells simulated in parallel")
    parser.add_argument("--sizes", nargs="*", type=int, default=[8, 32, 128],
                        help="replica counts")
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2], help="seeds")
    parser.add_argument("--duration-s", type=float, default=20.0,
                        help="virtual seconds of arrivals per cell")
    parser.add_argument("--arms", nargs="*", choices=ARMS, default=list(ARMS),
                        help="sharing policies to run")
    parser.add_argument("--workloads", nargs="*", choices=WORKLOADS, default=list(WORKLOADS),
                        help="workloads to run")
    parser.add_argument("--out", type=Path, default=results_of("router_tournament"),
                        help="folder of the results' .json and .md")
    parser.add_argument("--stem", default="tenant_fairness",
                        help="the results' file name without its suffix")
    parser.add_argument("--merge", nargs="*", type=Path, default=[],
                        help="simulate nothing: merge these runs' tenant_fairness.json "
                        "files into --out and write the report")
    args = parser.parse_args(argv)
    if args.merge:
        merged = {}  # a cell run twice (a cut run resumed): the later file's
        for path in args.merge:
            for cell in json.loads(path.read_text()):
                if cell["workload"] in WORKLOADS:  # not a workload since redefined
                    key = (cell["replicas"], cell["seed"], cell["workload"], cell["arm"])
                    merged[key] = cell
        return write_results(list(merged.values()), args.out, args.stem)
    cells = fairness_cells(args.sizes, args.seeds, args.duration_s, args.arms, args.workloads)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with multiprocessing.Pool(args.jobs) as pool:  # written as cells end: a cut run keeps them
        for result in pool.imap_unordered(run_fairness_cell, cells):
            results.append(result)
            (args.out / f"{args.stem}.json").write_text(json.dumps(results, indent=1))
    return write_results(results, args.out, args.stem)


def write_results(results: list[dict[str, Any]], out: Path, stem: str) -> int:
    results = sorted(results, key=lambda r: (r["replicas"], r["seed"], r["workload"], r["arm"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    text = report(results)
    (out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
