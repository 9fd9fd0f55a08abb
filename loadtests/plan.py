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
from pathlib import Path

from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.planner import ROUTERS, Slo, plan
from iterserve.replica.sim_runner import SimulatorConfig


def slo_argument(text: str) -> Slo:
    try:
        return Slo.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def gpu_config(spec: str) -> SimulatorConfig:
    if spec in ("h100", "h200"):
        return SimulatorConfig.preset(spec)
    path = Path(spec)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"--gpu: not h100, h200 or a JSON file: {spec!r}")
    return SimulatorConfig.from_mapping(json.loads(path.read_text()))


def main(argv: list[str] | None = None) -> int:
    """fewest replicas meeting a TTFT/ITL SLO, searched with the cluster simulator"""
    from iterserve.autoscale.sim.shapes import WORKLOADS, make
    from iterserve.autoscale.sim.traces import read_trace

    parser = argparse.ArgumentParser(prog="iterserve plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, help="JSONL or CSV trace (sim/traces.py)")
    source.add_argument("--workload", choices=sorted(WORKLOADS),
                        help="a named workload shape of the simulator")
    parser.add_argument("--rate", type=float, default=10.0, help="requests/s (--workload)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds (--workload)")
    parser.add_argument("--slo", type=slo_argument, default=Slo(),
                        help="ttft_p99=SECONDS,itl_p99=SECONDS to meet (default 2 and 0.1)")
    parser.add_argument("--gpu", type=gpu_config, default=SimulatorConfig.preset("h100"),
                        help="h100, h200 (Llama-3-8B bf16 presets) or a JSON file of CostModel / "
                             "SimulatorConfig fields")
    parser.add_argument("--router", choices=sorted(ROUTERS), default="iterserve",
                        help="the router each ingress runs")
    parser.add_argument("--routers", type=int, default=2, help="ingress routers")
    parser.add_argument("--max-replicas", type=int, default=256,
                        help="stop searching at this many replicas")
    parser.add_argument("--hash-block-size", type=int, default=None,
                        help="tokens per trace hash id (default: the trace's, else 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the simulator")
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
