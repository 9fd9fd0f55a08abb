"""The cluster simulator against the real Ray Serve path, side by side.

    python -m iterserve.loadtests.sim_validation [--ray-results loadtests/results/routing.json]

Replays `routing_experiment`'s workload (same seed and WorkloadConfig as the Ray results
file records) through `autoscale.cluster_sim` with the same engine settings (max_num_seqs,
token budget, block size, KV blocks, max_model_len), the same cost model slowed down by the
experiment's time_scale, one ingress router (the experiment's driver handle), the same
routing-stats period, and the same routers: Ray's power-of-two (`PowerOfTwo` below: two
random replicas, the one with fewer requests in flight, as Ray's default router does with
its queue-length probes) and iterserve's KVAwareRouter with and without prefix affinity
(`IterserveRouter`). Writes loadtests/results/sim_validation.md: p50 / p99 TTFT and
throughput per router from Ray and from the simulator, and their ratio (floor: within
15 %). The simulator arm is repeated over several seeds of its own randomness (poll
phases, tie-breaking), as the Ray arm pools repeated runs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

from iterserve.autoscale.cluster_sim import simulate
from iterserve.autoscale.cluster_sim_types import ClusterSimConfig, SimRequest, SimResult
from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.iterserve_routing import IterserveRouter
from iterserve.autoscale.percentile import percentile, percentile_of_counts
from iterserve.autoscale.routing_context import RouteRequest, RoutingContext
from iterserve.loadtests.routing_experiment import WorkloadConfig, make_workload
from iterserve.loadtests.sim_harness import RESULTS_DIR
from iterserve.replica.sim_runner import CostModel, SimulatorConfig


class PowerOfTwo:
    """Ray Serve's default router: two random candidates, fewer requests in flight wins."""

    name = "pow2"

    def choose(self, ctx: RoutingContext, rng: random.Random) -> Hashable:
        views = list(ctx.replicas)
        pair = rng.sample(views, 2) if len(views) >= 2 else views
        return min(pair, key=lambda v: v.ongoing).replica_id

    def on_routed(self, request: RouteRequest, replica_id: Hashable, now: float) -> None: ...
    def on_completed(self, request_id: str, replica_id: Hashable, now: float) -> None: ...
    def on_replicas_changed(self, replica_ids: Sequence[Hashable]) -> None: ...


ARM_ROUTERS = {
    "pow2 (Ray default)": lambda period: PowerOfTwo(),
    # as the Ray adapter runs: no replica cache answers (replicas do not report block hashes)
    "KVAware": lambda period: IterserveRouter(RouterConfig(prefix_affinity=False,
                                                           routing_stats_period_s=period),
                                              use_replica_cache=False),
    "KVAware + prefix": lambda period: IterserveRouter(RouterConfig(
        prefix_affinity=True, routing_stats_period_s=period), use_replica_cache=False),
}


def sim_workload(workload: WorkloadConfig) -> list[SimRequest]:
    return [SimRequest(s.request_id, s.send_at, tuple(s.prompt_token_ids), s.max_tokens)
            for s in make_workload(workload)]


def sim_config(meta: dict[str, Any], seed: int) -> ClusterSimConfig:
    engine = meta["engine_kwargs"]
    scale = float(meta["time_scale"])
    base = CostModel()
    slowed = CostModel(*(getattr(base, f) * scale for f in (
        "a_s", "b_s_per_prefill_token", "c_s_per_decode_seq", "d_s_per_kv_token")))
    return ClusterSimConfig(
        sim=SimulatorConfig(cost=slowed), max_num_seqs=engine["max_num_seqs"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        block_size=engine["block_size"], max_model_len=engine["max_model_len"],
        num_blocks=engine["num_gpu_blocks_override"],
        enable_prefix_caching=engine["enable_prefix_caching"],
        routing_stats_period_s=float(meta["period_s"]), seed=seed)


def pooled_summary(results: Sequence[SimResult]) -> dict[str, float]:
    ttfts = [t for r in results for t in r.ttfts()]
    gaps: dict[float, int] = {}
    for r in results:
        for gap, n in r.itl_counts.items():
            gaps[gap] = gaps.get(gap, 0) + n
    return {"itl_p99_s": percentile_of_counts(gaps, 99), "requests": len(results[0].records),
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "throughput_tok_s": sum(r.throughput() for r in results) / len(results),
            "preemptions": sum(sum(x.preemptions for x in r.records) for r in results)
            / len(results)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray-results", type=Path, nargs="+",
                        default=[RESULTS_DIR / "routing.json"],
                        help="routing_experiment JSON files (one per arm, or all arms in "
                             "one); they must share the workload and engine settings")
    parser.add_argument("--seeds", type=int, default=8, help="simulator runs per arm")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "sim_validation.md")
    args = parser.parse_args(argv)
    files = [json.loads(path.read_text()) for path in args.ray_results]
    meta = files[0]["meta"]
    for other in files[1:]:
        if (other["meta"]["workload"], other["meta"]["engine_kwargs"]) != (
                meta["workload"], meta["engine_kwargs"]):
            raise SystemExit("the Ray results files ran different workloads or engines")
    ray = {"meta": meta, "results": [r for f in files for r in f["results"]]}
    workload = WorkloadConfig(**{k: tuple(v) if isinstance(v, list) else v
                                 for k, v in meta["workload"].items()})
    requests = sim_workload(workload)
    rows = []
    for result in ray["results"]:
        ray_summary = result["summary"]
        arm = ray_summary["arm"]
        t0 = time.process_time()
        runs = [simulate(requests, [ARM_ROUTERS[arm](float(meta["period_s"]))],
                         int(meta["num_replicas"]), sim_config(meta, seed))
                for seed in range(args.seeds)]
        sim = pooled_summary(runs)
        rows.append((arm, ray_summary, sim, time.process_time() - t0))
    lines = [
        "# Cluster simulator vs the Ray Serve path",
        "",
        "`python -m iterserve.loadtests.sim_validation --ray-results "
        f"{' '.join(p.name for p in args.ray_results)}`"
        f" ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). Ray side: "
        f"`routing_experiment` run of {meta['when']} ({meta['num_replicas']} replicas, "
        f"time_scale {meta['time_scale']}, {ray['results'][0]['summary']['requests']} "
        f"requests x {meta['repeats']} runs per arm, pooled). Simulator: the same workload "
        f"and engine settings, {args.seeds} seeds per arm, pooled.",
        "",
        "| router | TTFT p50 Ray / sim (s) | ratio | TTFT p99 Ray / sim (s) | ratio "
        "| throughput Ray / sim (tok/s) | ratio | ITL p99 Ray / sim (s) | preemptions Ray / sim "
        "| Ray box load (1 min, 2 cores) | sim CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, r, s, cpu in rows:
        lines.append(
            f"| {arm} | {r['ttft_p50_s']:.3f} / {s['ttft_p50_s']:.3f} | "
            f"{s['ttft_p50_s'] / r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.3f} / "
            f"{s['ttft_p99_s']:.3f} | {s['ttft_p99_s'] / r['ttft_p99_s']:.2f} | "
            f"{r['throughput_tok_s']:.0f} / {s['throughput_tok_s']:.0f} | "
            f"{s['throughput_tok_s'] / r['throughput_tok_s']:.2f} | {r['itl_p99_s']:.3f} / "
            f"{s['itl_p99_s']:.3f} | {r['preemptions']:g} / {s['preemptions']:g} | "
            f"{r.get('loadavg_1m_at_end', float('nan')):.1f} | {cpu:.1f} |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
