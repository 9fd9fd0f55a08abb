"""The cluster simulator against the real Ray Serve path, side by side.

    python -m iterserve.loadtests.studies.sim_validation.sim_validation --ray-results A.json [B.json ...] \
        [--ray-path-latency loadtests/studies/sim_validation/results/ray_path_latency.json]

Replays `routing_experiment`'s workload (same seed and WorkloadConfig as the Ray results
file records) through `autoscale.sim.cluster` with the same engine settings (max_num_seqs,
token budget, block size, KV blocks, max_model_len), the same cost model slowed down by the
experiment's time_scale, one ingress router (the experiment's driver handle), the same
routing-stats period, and the same routers: Ray's power-of-two (`PowerOfTwo` below: two
random replicas, the one with fewer requests in flight, as Ray's default router does with
its queue-length probes), iterserve's KVAwareRouter with and without prefix affinity
(`IterserveRouter`), and our reimplementation of Ray's PrefixCacheAffinityRouter
(`RayPrefixAffinityRouter`) for both the Ray arm that ran it and the Ray arm that ran Ray's
own router. The simulator arm is repeated over several seeds of its own randomness (poll
phases, tie-breaking), as the Ray arm pools repeated runs.

The Ray path's own latency outside the replicas (dispatch: handle call -> replica; return:
engine -> driver) is not fitted: it is the median that `ray_path_latency` measured with one
request in flight, passed as `ClusterSimConfig.dispatch_latency_s` / `stream_latency_s`.
The report shows the simulator with and without it, the Ray run's own split of each TTFT
around the engine (`ClientRecord` timestamps), and Ray's router beside ours. With
`--engine-cpu` the simulated replicas' steps also last the engine's own CPU time per step,
which the simulated runner does not overlap with its modelled GPU time and the cost model
leaves out: `--engine-cpu measured` takes what each Ray run's own replicas measured (their
simulated runners' `DeviceIdleMeter`, recorded by routing_experiment since 2026-12-03);
a path takes engine_cpu_overhead's JSON (one quiet process: a lower bound).
Writes loadtests/studies/sim_validation/results/sim_validation.md (floor: p50 / p99 TTFT and throughput within
15 % per router).
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

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.percentile import percentile, percentile_of_counts
from iterserve.autoscale.sim.baseline_cache_routers import RayPrefixAffinityRouter
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.autoscale.sim.results import SimResult
from iterserve.autoscale.sim.routing_context import RouteRequest, RoutingContext, RoutingPolicy
from iterserve.autoscale.sim.traces import read_trace, speed_up, trace_digest
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.loadtests.studies import results_of
from iterserve.loadtests.studies.ray_routing.routing_experiment import WorkloadConfig, make_workload
from iterserve.loadtests.studies.sim_validation.sim_validation_report import Row, write_report
from iterserve.replica.device_idle import WaitDistribution
from iterserve.replica.sim_runner import CostModel, SimulatorConfig

EngineCpu = tuple[float, float]  # the engine's CPU seconds per step, per decoding sequence


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
    # Ray's own router and our reimplementation both have the reimplementation as model
    "ray-prefix (ours)": lambda period: RayPrefixAffinityRouter(),
    "PrefixCacheAffinityRouter (Ray 2.60)": lambda period: RayPrefixAffinityRouter(),
}
# iterserve's own arms in Ray results that do not record their RouterConfig (before
# routing_experiment did, 2026-12-03): the router as the Ray adapter then ran, with no
# replica cache answers (before the replicas reported block hashes) and no prefill drain
# (before drain_inflight_prefill)
LEGACY_PREFIX_AFFINITY = {"KVAware": False, "KVAware + prefix": True}


def sim_router(arm: str, period_s: float, recorded: dict[str, Any] | None) -> RoutingPolicy:
    """The simulator's router for a Ray arm: the RouterConfig the Ray run recorded for it,
    or the legacy settings above for an iterserve arm that recorded none."""
    if arm in ARM_ROUTERS:
        return ARM_ROUTERS[arm](period_s)
    if recorded is not None:
        config = RouterConfig(**recorded)
        return IterserveRouter(config, use_replica_cache=config.use_replica_cache_reports)
    if arm not in LEGACY_PREFIX_AFFINITY:
        raise SystemExit(f"no simulator router for the Ray arm {arm!r}")
    return IterserveRouter(RouterConfig(prefix_affinity=LEGACY_PREFIX_AFFINITY[arm],
                                        routing_stats_period_s=period_s,
                                        drain_inflight_prefill=False),
                           use_replica_cache=False)


def sim_workload(workload: WorkloadConfig) -> list[WorkloadRequest]:
    return [WorkloadRequest(s.request_id, s.arrival_time, tuple(s.prompt_token_ids), s.max_tokens)
            for s in make_workload(workload)]


def workload_of(meta: dict[str, Any]) -> list[WorkloadRequest]:
    """The requests a Ray run drove, as the simulator's: its generated workload, or the
    trace it replayed (the file must be the one it recorded) at its arrival times, which
    `ray_trace` stretched by the time scale and divided by the speed. A chat's next turn
    holds the previous answer on both paths: there the runner's seeded tokens, here the
    simulated replica's (`sim/traces.py`), the same blocks shared either way."""
    workload = meta["workload"]
    if "trace" not in workload:
        return sim_workload(WorkloadConfig(**{k: tuple(v) if isinstance(v, list) else v
                                              for k, v in workload.items()}))
    if trace_digest(workload["trace"]) != workload["trace_sha256"]:
        raise SystemExit(f"{workload['trace']} is not the trace the Ray run replayed "
                         "(its sha256 differs)")
    requests = read_trace(workload["trace"], workload.get("hash_block_size"))
    return speed_up(requests, float(workload["speed"]) / float(meta["time_scale"]))


def sim_config(meta: dict[str, Any], seed: int, dispatch_latency_s: float = 0.0,
               stream_latency_s: float = 0.0, engine_cpu: EngineCpu = (0.0, 0.0),
               engine_waits: WaitDistribution | None = None) -> ClusterSimConfig:
    """The Ray run's engine in the simulator: the cost model slowed by its time_scale, plus
    `engine_cpu` (seconds per step, per decoding sequence: the engine's own CPU time, real
    seconds, so not scaled; `engine_cpu_overhead` measures it), or single waits drawn from
    `engine_waits` before every step that continues a batch."""
    engine = meta["engine_kwargs"]
    scale = float(meta["time_scale"])
    base = CostModel()
    per_step, per_seq = engine_cpu
    slowed = CostModel(base.a_s * scale + per_step, base.b_s_per_prefill_token * scale,
                       base.c_s_per_decode_seq * scale + per_seq, base.d_s_per_kv_token * scale)
    return ClusterSimConfig(
        sim=SimulatorConfig(cost=slowed), max_num_seqs=engine["max_num_seqs"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        block_size=engine["block_size"], max_model_len=engine["max_model_len"],
        num_blocks=engine["num_gpu_blocks_override"],
        enable_prefix_caching=engine["enable_prefix_caching"],
        routing_stats_period_s=float(meta["period_s"]), seed=seed,
        dispatch_latency_s=dispatch_latency_s, stream_latency_s=stream_latency_s,
        engine_waits=engine_waits)


MEASURED = "measured"  # --engine-cpu: each Ray run's own replicas' measurement
MEASURED_WAITS = "measured-waits"  # --engine-cpu: drawn from their single waits


def read_engine_waits(summary: dict[str, Any]) -> WaitDistribution:
    """The Ray arm's single engine-CPU waits: its histogram (`engine_cpu_waits`) where the
    run kept it, else the quantiles its fit report kept."""
    fit = summary.get("engine_cpu")
    if fit is None or "p99_idle_s" not in fit:
        raise SystemExit(f"the Ray run of {summary.get('arm')!r} did not record its single "
                         "engine-CPU waits (routing_experiment before 2026-12-04)")
    if "engine_cpu_waits" in summary:
        return WaitDistribution.from_histogram(summary["engine_cpu_waits"], fit["mean_idle_s"],
                                               fit["per_seq_s"], fit["mean_batch"])
    return WaitDistribution.from_quantiles(fit)


def read_engine_cpu(spec: str | None, summary: dict[str, Any] | None = None) -> EngineCpu:
    """The engine CPU term (per step, per sequence): none; MEASURED, the fit the Ray run's
    replicas measured (`summary["engine_cpu"]`, from their simulated runners'
    DeviceIdleMeter); or the path of engine_cpu_overhead's JSON."""
    if spec is None:
        return (0.0, 0.0)
    if spec == MEASURED:
        if summary is None or "engine_cpu" not in summary:
            arm = None if summary is None else summary.get("arm")
            raise SystemExit(f"the Ray run of {arm!r} did not record its engine CPU "
                             "(routing_experiment before the replicas' DeviceIdleMeter)")
        fit = summary["engine_cpu"]
    else:
        fit = json.loads(Path(spec).read_text())
    return (float(fit["per_step_s"]), float(fit["per_seq_s"]))


def k_run_p99_range(per_seed: Sequence[Sequence[float]], k: int, draws: int = 1000
                    ) -> tuple[float, float]:
    """The simulator's own run-to-run spread at the Ray side's sample size: the 2.5th and
    97.5th percentiles of the pooled p99 TTFT of `draws` random k-seed pools (seeds drawn
    without replacement; a fixed RNG, so the report is reproducible)."""
    if not 1 <= k <= len(per_seed):
        raise ValueError(f"k must be in [1, {len(per_seed)}], got {k}")
    rng = random.Random(0)
    p99s = sorted(percentile([t for i in rng.sample(range(len(per_seed)), k)
                              for t in per_seed[i]], 99) for _ in range(draws))
    return percentile(p99s, 2.5), percentile(p99s, 97.5)


def pooled_summary(results: Sequence[SimResult], k_runs: int = 1) -> dict[str, Any]:
    """The simulator runs pooled; `k_runs` (the Ray arm's run count) sizes the k-run range."""
    ttfts = [t for r in results for t in r.ttfts()]
    gaps: dict[float, int] = {}
    for r in results:
        for gap, n in r.itl_counts.items():
            gaps[gap] = gaps.get(gap, 0) + n
    done = [x for r in results for x in r.records if x.done]
    prompt = sum(x.prompt_tokens for x in done)
    return {"itl_p99_s": percentile_of_counts(gaps, 99), "requests": len(results[0].records),
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "ttft_p99_per_seed_s": [r.ttft_percentile(99) for r in results],
            "k_runs": k_runs,
            "ttft_p99_k_run_95_s": k_run_p99_range([r.ttfts() for r in results],
                                                   min(k_runs, len(results))),
            "throughput_tok_s": sum(r.throughput() for r in results) / len(results),
            "preemptions": sum(sum(x.preemptions for x in r.records) for r in results)
            / len(results),
            "prefix_hit_rate": sum(x.cached_tokens for x in done) / prompt if prompt else 0.0}


def load_ray_results(paths: Sequence[Path]) -> dict[str, Any]:
    files = [json.loads(path.read_text()) for path in paths]
    meta = files[0]["meta"]
    for other in files[1:]:
        if (other["meta"]["workload"], other["meta"]["engine_kwargs"],
                other["meta"]["time_scale"]) != (meta["workload"], meta["engine_kwargs"],
                                                 meta["time_scale"]):
            raise SystemExit("the Ray results files ran different workloads or engines")
    for f in files:  # files written before the pooled summary kept its runs' box load
        for r in f["results"]:
            loads = [run["loadavg_1m_at_end"] for run in f["meta"].get("per_run", [])
                     if run["arm"] == r["summary"]["arm"] and "loadavg_1m_at_end" in run]
            if loads and "loadavg_1m_at_end" not in r["summary"]:
                r["summary"]["loadavg_1m_at_end"] = max(loads)
    # each result with its run's RouterConfig (None: not recorded) and a label: its arm, and
    # the run's time where two files ran the same arm (e.g. before and after a router change)
    results = [{**r, "router_config": f["meta"].get("router_configs", {}).get(r["summary"]["arm"]),
                "when": f["meta"]["when"]} for f in files for r in f["results"]]
    arms = [r["summary"]["arm"] for r in results]
    for r, arm in zip(results, arms, strict=True):
        r["label"] = arm if arms.count(arm) == 1 else f"{arm} (Ray run {r['when']})"
    return {"meta": meta, "metas": [f["meta"] for f in files], "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray-results", type=Path, nargs="+",
                        default=[results_of("ray_routing") / "routing.json"],
                        help="routing_experiment JSON files (one per arm, or all arms in "
                             "one); they must share the workload and engine settings")
    parser.add_argument("--ray-path-latency", type=Path,
                        default=results_of("sim_validation") / "ray_path_latency.json",
                        help="ray_path_latency's JSON: its dispatch / return medians become "
                             "the simulator's dispatch_latency_s / stream_latency_s")
    parser.add_argument("--engine-cpu", default=None,
                        help="the engine's CPU time per step (which the simulated runner "
                             "does not overlap) added to the simulated replicas' step "
                             f"times: '{MEASURED}' (the line each Ray run's replicas "
                             f"measured), '{MEASURED_WAITS}' (each step's wait drawn from "
                             "their single waits, tail included) or engine_cpu_overhead's "
                             "JSON; default none")
    parser.add_argument("--seeds", type=int, default=8, help="simulator runs per arm")
    parser.add_argument("--out", type=Path, default=results_of("sim_validation") / "sim_validation.md",
                        help="where the markdown report goes")
    args = parser.parse_args(argv)
    ray = load_ray_results(args.ray_results)
    meta = ray["meta"]
    probe = json.loads(args.ray_path_latency.read_text())
    dispatch_s, stream_s = float(probe["dispatch_p50_s"]), float(probe["return_p50_s"])
    requests = workload_of(meta)
    rows = []
    for result in ray["results"]:
        arm, label = result["summary"]["arm"], result["label"]
        t0 = time.process_time()
        waits = read_engine_waits(result["summary"]) if args.engine_cpu == MEASURED_WAITS \
            else None
        engine_cpu = read_engine_cpu(None if waits else args.engine_cpu, result["summary"])
        sims = {}
        for sim_kind, latency in (("engine", (0.0, 0.0)), ("path", (dispatch_s, stream_s))):
            runs = [simulate(requests, [sim_router(arm, float(meta["period_s"]),
                                                   result["router_config"])],
                             int(meta["num_replicas"]),
                             sim_config(meta, seed, *latency, engine_cpu=engine_cpu,
                                        engine_waits=waits))
                    for seed in range(args.seeds)]
            sims[sim_kind] = pooled_summary(runs, int(result["summary"].get("runs", 1)))
        rows.append(Row(label, result["summary"], sims["path"], sims["engine"],
                        time.process_time() - t0, engine_cpu))
    command = ("python -m iterserve.loadtests.studies.sim_validation.sim_validation --ray-results "
               + " ".join(p.name for p in args.ray_results)
               + f" --ray-path-latency {args.ray_path_latency.name} --seeds {args.seeds}"
               + (f" --engine-cpu {Path(args.engine_cpu).name}" if args.engine_cpu else ""))
    text = write_report(rows, ray, probe, command, args.seeds)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
