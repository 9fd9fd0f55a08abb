"""`iterserve plan`: the fewest replicas that meet a latency SLO, found with the simulator.

    iterserve plan --workload multi-tenant --rate 20 --duration 120 \\
        --slo ttft_p99=2,itl_p99=0.1 --gpu h100
    iterserve plan --trace loadtests/traces/example_multi_turn.jsonl --gpu h200
    iterserve plan --workload steady --rate 50 --gpu my_gpu.json --router iterserve

It simulates the workload (a generator of `autoscale/sim/shapes` at --rate requests/s
for --duration s, or a trace replayed as recorded) on n replicas, doubling n until the SLO
holds, then bisects down to the fewest that meet it, and prints every point it tried.
--gpu names a preset (h100, h200: Llama-3-8B bf16, published figures) or a JSON file of
`CostModel` / `SimulatorConfig` fields, e.g. {"preset": "h100", "a_s": 0.0061, ...}.

Measured coefficients: on the GPU, `python -m iterserve.loadtests.cost_model_probe --model
DIR --device cuda --out gpu.json` times every engine step, fits `CostModel.fit(samples)`
(least squares over (prefill_tokens, decode_seqs, kv_tokens_read, seconds) per step) and
writes the JSON to pass as --gpu gpu.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.policies import IterserveRouter
from iterserve.autoscale.sim.routing_context import RoutingPolicy
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.replica.sim_runner import SimulatorConfig

ROUTERS: dict[str, Callable[[], RoutingPolicy]] = {"iterserve": IterserveRouter}


@dataclass(frozen=True)
class Slo:
    ttft_p99_s: float = 2.0
    itl_p99_s: float = 0.1

    @classmethod
    def parse(cls, text: str) -> Slo:
        """``ttft_p99=2,itl_p99=0.1`` (seconds)."""
        values = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            if name not in ("ttft_p99", "itl_p99") or not value:
                raise argparse.ArgumentTypeError(
                    f"bad SLO term {part!r}: want ttft_p99=SECONDS and/or itl_p99=SECONDS")
            values[f"{name}_s"] = float(value)
        return cls(**values)


@dataclass(frozen=True)
class PlanPoint:
    replicas: int
    ttft_p99_s: float
    itl_p99_s: float
    throughput_tok_s: float
    finished: int
    requests: int

    def meets(self, slo: Slo) -> bool:
        return (self.finished == self.requests and self.ttft_p99_s <= slo.ttft_p99_s
                and self.itl_p99_s <= slo.itl_p99_s)


def gpu_config(spec: str) -> SimulatorConfig:
    if spec in ("h100", "h200"):
        return SimulatorConfig.preset(spec)
    path = Path(spec)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"--gpu: not h100, h200 or a JSON file: {spec!r}")
    return SimulatorConfig.from_mapping(json.loads(path.read_text()))


def evaluate(workload: Sequence[WorkloadRequest], replicas: int, config: ClusterSimConfig,
             router: str, num_routers: int) -> PlanPoint:
    result = simulate(workload, [ROUTERS[router]() for _ in range(num_routers)], replicas,
                      config)
    return PlanPoint(replicas, result.ttft_percentile(99), result.itl_percentile(99),
                     result.throughput(), result.num_finished, len(workload))


def plan(workload: Sequence[WorkloadRequest], slo: Slo, config: ClusterSimConfig,
         router: str = "iterserve", num_routers: int = 2, max_replicas: int = 256,
         ) -> tuple[int | None, list[PlanPoint]]:
    """(fewest replicas meeting the SLO or None up to max_replicas, every point tried)."""
    tried: dict[int, PlanPoint] = {}

    def point(n: int) -> PlanPoint:
        if n not in tried:
            tried[n] = evaluate(workload, n, config, router, num_routers)
        return tried[n]

    n, low = 1, 0  # low: the most replicas known to miss the SLO
    while not point(n).meets(slo):
        low = n
        if n >= max_replicas:
            return None, sorted(tried.values(), key=lambda p: p.replicas)
        n = min(2 * n, max_replicas)
    high = n
    while high - low > 1:
        mid = (low + high) // 2
        if point(mid).meets(slo):
            high = mid
        else:
            low = mid
    return high, sorted(tried.values(), key=lambda p: p.replicas)


def main(argv: list[str] | None = None) -> int:
    """fewest replicas meeting a TTFT/ITL SLO, searched with the cluster simulator"""
    from iterserve.autoscale.sim.shapes import WORKLOADS, make
    from iterserve.autoscale.sim.traces import read_trace

    parser = argparse.ArgumentParser(prog="iterserve plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, help="JSONL or CSV trace (cluster_trace)")
    source.add_argument("--workload", choices=sorted(WORKLOADS))
    parser.add_argument("--rate", type=float, default=10.0, help="requests/s (--workload)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds (--workload)")
    parser.add_argument("--slo", type=Slo.parse, default=Slo())
    parser.add_argument("--gpu", type=gpu_config, default=SimulatorConfig.preset("h100"))
    parser.add_argument("--router", choices=sorted(ROUTERS), default="iterserve")
    parser.add_argument("--routers", type=int, default=2, help="ingress routers")
    parser.add_argument("--max-replicas", type=int, default=256)
    parser.add_argument("--hash-block-size", type=int, default=None,
                        help="tokens per trace hash id (default: the trace's, else 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.trace is not None:
        workload = read_trace(args.trace, args.hash_block_size)
    else:
        workload = make(args.workload, args.rate, args.duration, args.seed)
    config = ClusterSimConfig(sim=args.gpu, seed=args.seed)
    best, curve = plan(workload, args.slo, config, args.router, args.routers, args.max_replicas)
    if args.json:
        print(json.dumps({"replicas": best, "slo": vars(args.slo),
                          "curve": [vars(p) | {"meets": p.meets(args.slo)} for p in curve]}))
        return 0 if best is not None else 1
    print(f"{len(workload)} requests; SLO p99 TTFT <= {args.slo.ttft_p99_s}s, "
          f"p99 ITL <= {args.slo.itl_p99_s}s; router {args.router} x {args.routers}")
    print("replicas  p99 TTFT s  p99 ITL s  tokens/s  finished  meets")
    for p in curve:
        print(f"{p.replicas:8d}  {p.ttft_p99_s:10.3f}  {p.itl_p99_s:9.4f}  "
              f"{p.throughput_tok_s:8.0f}  {p.finished:8d}  {'yes' if p.meets(args.slo) else 'no'}")
    if best is None:
        print(f"no replica count up to {args.max_replicas} meets the SLO")
        return 1
    print(f"fewest replicas meeting the SLO: {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
