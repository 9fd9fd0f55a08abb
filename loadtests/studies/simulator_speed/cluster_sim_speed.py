"""Speed floor of the cluster simulator: N replicas x D virtual seconds at a load fraction.

    python -m iterserve.loadtests.studies.simulator_speed.cluster_sim_speed --replicas 64 \
        --duration 600 --load 0.8 \
        --router iterserve --autoscaler

Load is relative to the capacity of one simulated replica on the workload (requests/s it
completes when saturated, measured first on one replica), times the replica count.
--router iterserve is the production router (`iterserve_router.IterserveRouter`: the
`KVRouterCore` the Ray adapter calls, with the replicas' own prefix-cache answers), one per
ingress router; --autoscaler runs the production autoscaling policy every
autoscale_interval_s on pushed metrics, its bounds pinned at N so that the run stays at N
replicas. Prints wall and CPU seconds, peak memory, the box's load average, requests,
engine steps and the summary (--digest: and the sha256 of the whole result's JSON).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import sys
import time
from collections.abc import Hashable, Sequence

from iterserve.autoscale.config import AutoscaleConfig
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.autoscale.sim.policies import IterserveAutoscaler
from iterserve.autoscale.sim.routing_context import RouteRequest, RoutingContext
from iterserve.autoscale.sim.shapes import make


class RoundRobin:
    """The cheapest router: isolates the simulator's own cost from the router's."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        self._next += 1
        return ctx.replicas[self._next % len(ctx.replicas)].replica_id

    def on_routed(self, request: RouteRequest, replica_id: Hashable, now: float) -> None: ...
    def on_completed(self, request_id: str, replica_id: Hashable, now: float) -> None: ...
    def on_replicas_changed(self, replica_ids: Sequence[Hashable]) -> None: ...


ROUTERS = {"iterserve": IterserveRouter, "round-robin": RoundRobin}


def replica_capacity(workload: str, config: ClusterSimConfig, seed: int = 0,
                     probe_rate: float = 40.0, probe_s: float = 60.0) -> float:
    """Requests/s one replica completes when saturated by `workload`."""
    result = simulate(make(workload, probe_rate, probe_s, seed), [IterserveRouter()], 1, config)
    return result.num_finished / result.end_time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=64, help="simulated replicas")
    parser.add_argument("--duration", type=float, default=600.0, help="virtual seconds")
    parser.add_argument("--load", type=float, default=0.8,
                        help="fraction of the replicas' capacity offered")
    parser.add_argument("--workload", default="steady", help="the simulator's workload shape")
    parser.add_argument("--routers", type=int, default=2, help="ingress routers")
    parser.add_argument("--router", choices=sorted(ROUTERS), default="iterserve",
                        help="the router every ingress runs")
    parser.add_argument("--capacity", type=float, default=None,
                        help="requests/s per replica (default: measure it first)")
    parser.add_argument("--autoscaler", action="store_true",
                        help="run the production autoscaling policy (bounds pinned at N)")
    parser.add_argument("--no-fast-forward", action="store_true",
                        help="advance decode stretches step by step (slower; the same results)")
    parser.add_argument("--progress", action="store_true",
                        help="print (virtual s, CPU s, wall s) to stderr every 10 virtual s")
    parser.add_argument("--digest", action="store_true",
                        help="also print the sha256 of the result's JSON (same seed, same "
                        "digest; computed after the timing)")
    args = parser.parse_args(argv)
    config = ClusterSimConfig(fast_forward=not args.no_fast_forward)
    capacity = args.capacity or replica_capacity(args.workload, config)
    rate = args.load * capacity * args.replicas
    t0 = time.perf_counter()
    workload = make(args.workload, rate, args.duration)
    autoscaler = IterserveAutoscaler(AutoscaleConfig(
        min_replicas=args.replicas, max_replicas=args.replicas)) if args.autoscaler else None
    load_before = os.getloadavg()
    t1, c1 = time.perf_counter(), time.process_time()
    def heartbeat(virtual_s: float) -> None:
        print(json.dumps({"virtual_s": round(virtual_s, 3),
                          "cpu_s": round(time.process_time() - c1, 2),
                          "wall_s": round(time.perf_counter() - t1, 2)}),
              file=sys.stderr, flush=True)

    result = simulate(workload, [ROUTERS[args.router]() for _ in range(args.routers)],
                      args.replicas, config, autoscaler,
                      progress=heartbeat if args.progress else None)
    t2, c2 = time.perf_counter(), time.process_time()
    print(json.dumps({"router": args.router, "autoscaler": args.autoscaler,
                      "replicas": args.replicas, "virtual_s": args.duration,
                      "load": args.load, "capacity_req_s_per_replica": capacity,
                      "rate_req_s": rate, "requests": len(workload),
                      "workload_wall_s": t1 - t0, "simulate_wall_s": t2 - t1,
                      "simulate_cpu_s": c2 - c1,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
                      **result.summary()}, indent=1))
    if args.digest:
        print(json.dumps({"result_sha256": hashlib.sha256(result.to_json().encode()).hexdigest()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
