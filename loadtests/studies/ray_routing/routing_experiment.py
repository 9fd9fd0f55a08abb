"""Routing experiment: Ray's default power-of-two router vs KVAwareRouter (with and without
prefix affinity) on 4 simulated replicas, same seeded skewed and bursty workload.

    python -m iterserve.loadtests.studies.ray_routing.routing_experiment [--quick] [--seed 0] [--out DIR]
    python -m iterserve.loadtests.studies.ray_routing.routing_experiment --trace FILE [--trace-speed K] ...

Each arm deploys deploy's `LLMReplica` (engine runner="simulated") x 4 as its own Serve app
and drives it through a DeploymentHandle from this process, so the router under test is the
one inside this process's handle (exactly where the ingress's router sits in production);
no HTTP proxy or ingress spends the 2 CPUs. The workload, engine settings and simulated GPU
are identical across arms. Writes loadtests/studies/ray_routing/results/routing.md, routing.json and
routing_kv.png (per-replica KV usage over time), routing_ttft.png.

--trace FILE replays a recorded trace (`sim/traces.py` formats) in place of the generated
workload, its arrival times stretched by --time-scale (the simulated GPU is that much
slower) and divided by --trace-speed (`ray_trace`); the results record the trace, so that
`sim_validation` replays the same requests.

The load-driving harness (`drive`, `ReplicaStatsPoller`, `start_ray`) lives in
`ray_harness`, shared with `autoscale_experiment` and the Ray integration tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.percentile import percentile
from iterserve.autoscale.sim.arrivals import poisson_times
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.loadtests.studies import results_of
from iterserve.loadtests.studies.ray_harness import (
    DEFAULT_TIME_SCALE,
    ClientRecord,
    ReplicaStatsPoller,
    device_idle_reports,
    drive,
    hop_summary,
    replica_app,
    start_ray,
)
from iterserve.replica.device_idle import fit_report, merge_reports

# Engine per replica: a deliberately small KV cache (num_gpu_blocks_override) so that a few
# long requests fill it, as on a GPU serving long contexts; chunked prefill; prefix caching.
ENGINE_KWARGS: dict[str, Any] = {
    "runner": "simulated",
    "max_num_seqs": 48,
    "max_num_batched_tokens": 2048,
    "block_size": 16,
    "num_gpu_blocks_override": 640,  # 10240 tokens of KV per replica
    "max_model_len": 4096,
    "enable_prefix_caching": True,
}


# ----------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class WorkloadConfig:
    seed: int = 0
    duration_s: float = 60.0
    base_rate: float = 1.5  # Poisson arrivals per second outside bursts
    burst_every_s: float = 12.0
    burst_size: int = 12  # requests arriving within burst_len_s
    burst_len_s: float = 1.0
    long_fraction: float = 0.25
    short_prompt: tuple[int, int] = (64, 384)
    short_output: tuple[int, int] = (16, 128)
    long_prompt: tuple[int, int] = (1536, 3072)
    long_output: tuple[int, int] = (128, 384)
    num_prefixes: int = 6  # shared "system prompts", Zipf-popular
    prefix_len: int = 256
    prefix_fraction: float = 0.6  # requests that start with one of them
    vocab_size: int = 4096



def make_workload(cfg: WorkloadConfig) -> list[WorkloadRequest]:
    """A seeded, skewed, bursty request list (same seed, same list)."""
    rng = random.Random(cfg.seed)
    prefixes = [
        [rng.randrange(5, cfg.vocab_size) for _ in range(cfg.prefix_len)]
        for _ in range(cfg.num_prefixes)
    ]
    zipf = [1.0 / (i + 1) for i in range(cfg.num_prefixes)]
    times = poisson_times(rng, cfg.base_rate, cfg.duration_s)
    burst = cfg.burst_every_s / 2
    while burst < cfg.duration_s:
        times += [burst + rng.uniform(0, cfg.burst_len_s) for _ in range(cfg.burst_size)]
        burst += cfg.burst_every_s
    requests = []
    for i, at in enumerate(sorted(times)):
        is_long = rng.random() < cfg.long_fraction
        lo, hi = cfg.long_prompt if is_long else cfg.short_prompt
        n_prompt = rng.randint(lo, hi)
        olo, ohi = cfg.long_output if is_long else cfg.short_output
        prompt: list[int] = []
        if cfg.num_prefixes and rng.random() < cfg.prefix_fraction:
            prompt = list(rng.choices(prefixes, weights=zipf)[0])
        prompt += [rng.randrange(5, cfg.vocab_size) for _ in range(max(1, n_prompt - len(prompt)))]
        requests.append(WorkloadRequest(f"req-{cfg.seed}-{i}", at, prompt, rng.randint(olo, ohi),
                                        kind="long" if is_long else "short"))
    return requests


def preemptions_between(samples: Sequence[dict[str, Any]]) -> int:
    """Sum over replicas of (last - first) cumulative num_preemptions in the samples."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for s in samples:
        first.setdefault(s["replica"], s.get("num_preemptions", 0.0))
        last[s["replica"]] = s.get("num_preemptions", 0.0)
    return int(sum(last[k] - first[k] for k in last))


def summarize(records: Sequence[ClientRecord], preemptions: int, runs: int = 1
              ) -> dict[str, Any]:
    """Latency and throughput over records (pooled over `runs` runs of the same workload)."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    start = min(r.sent for r in records)
    end = max(r.finished or r.sent for r in records)
    tokens = sum(r.num_tokens for r in ok)
    makespan = (end - start) if runs == 1 else math.nan
    return {
        "requests": len(records) // runs,
        "failed": len(records) - len(ok),
        "throughput_tok_s": tokens / (end - start) if runs == 1 and end > start else math.nan,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_p99_long_s": percentile([r.ttft for r in ok if r.kind == "long" and r.ttft], 99),
        "ttft_p99_short_s": percentile([r.ttft for r in ok if r.kind != "long" and r.ttft], 99),
        "itl_p99_s": percentile(gaps, 99),
        "preemptions": preemptions / runs,
        "makespan_s": makespan,
        **hop_summary(records),  # the Ray path's own latency around the engine
    }


# ------------------------------------------------------------------------------ the arms
def arm_router(name: str, period_s: float) -> Any:  # noqa: ANN401
    from iterserve.autoscale.router import request_router_config

    if name in COMPARISON_ARMS:
        from iterserve.loadtests.studies.ray_routing.ray_routers import router_config_for

        return router_config_for(name, period_s, ENGINE_KWARGS["block_size"])
    if name == "pow2 (Ray default)":
        from ray.serve.config import RequestRouterConfig

        # Ray's default router, with the same stats period so only the policy differs.
        return RequestRouterConfig(request_routing_stats_period_s=period_s)
    return request_router_config(iterserve_router_config(name, period_s))


def iterserve_router_config(name: str, period_s: float) -> RouterConfig | None:
    """The RouterConfig of one of iterserve's own arms (recorded with the results, so that
    sim_validation simulates the router the Ray run had); None for a Ray or baseline arm."""
    if name in COMPARISON_ARMS or name == "pow2 (Ray default)":
        return None
    affinity = name.endswith("+ prefix") or name == NO_REPORTS_ARM
    return RouterConfig(prefix_affinity=affinity, routing_stats_period_s=period_s,
                        use_replica_cache_reports=name != NO_REPORTS_ARM)


# Ray's own prefix-cache router and our reimplementation of it (the tournament's
# "ray-prefix", `autoscale.sim.baseline_cache_routers`), side by side (see `ray_routers`).
COMPARISON_ARMS = ("ray-prefix (ours)", "PrefixCacheAffinityRouter (Ray 2.60)")
# KVAware + prefix without the replicas' cache reports: the router as the Ray adapter ran
# before the replicas sent their block hashes (appended: the other arms keep their indices).
NO_REPORTS_ARM = "KVAware + prefix, no cache reports"
ARMS = ("pow2 (Ray default)", "KVAware", "KVAware + prefix", *COMPARISON_ARMS, NO_REPORTS_ARM)


async def run_arm(name: str, idx: int, specs: Sequence[WorkloadRequest], num_replicas: int,
                  engine_kwargs: dict[str, Any], period_s: float) -> dict[str, Any]:
    from ray import serve

    app_name = f"routing{idx}"
    app = replica_app(engine_kwargs, num_replicas=num_replicas,
                      router=arm_router(name, period_s))
    t_deploy = time.monotonic()
    handle = await asyncio.to_thread(serve.run, app, name=app_name, route_prefix=None)
    print(f"[{name}] deployed {num_replicas} replicas in {time.monotonic() - t_deploy:.1f}s",
          flush=True)
    poller = ReplicaStatsPoller(app_name)
    await poller._poll_once()  # baseline preemption counters
    poller.start()
    t0, records = await drive(handle, specs)
    await asyncio.sleep(1.0)
    await poller.stop()
    await poller._poll_once()
    idle = await device_idle_reports(handle)
    preemptions = preemptions_between(poller.samples)
    summary = summarize(records, preemptions)
    summary["arm"] = name
    if idle:  # the replicas' engine CPU per step, as their simulated GPUs waited for it
        merged = merge_reports(idle)
        summary["engine_cpu"] = fit_report(merged)
        # every single wait, bucketed: what a simulator would draw each step's wait from
        summary["engine_cpu_waits"] = merged.report()["histogram"]
    summary["loadavg_1m_at_end"] = os.getloadavg()[0]  # other work on a shared machine
    print(f"[{name}] {json.dumps(summary)}", flush=True)
    await asyncio.wait_for(asyncio.to_thread(serve.delete, app_name), 180)
    return {
        "summary": summary,
        "kv": [{"t": s["t"] - t0, "replica": s["replica"], "kv_usage": s["kv_usage"],
                "num_waiting": s["num_waiting"]} for s in poller.samples],
        "ttfts": [(r.sent - t0, r.ttft) for r in records if r.ttft is not None],
        "records": records,
        "preemptions": preemptions,
    }


def write_report(results: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    rows = [r["summary"] for r in results]
    base = rows[0]
    workload = meta["workload"]
    source = (f"seed {meta['seed']}" if "trace" not in workload else
              f"replayed from `{workload['trace']}` (sha256 {workload['trace_sha256'][:12]}..., "
              f"speed {workload['speed']:g}; `--trace`)")
    lines = [
        "# Routing experiment: pow2 vs KVAwareRouter",
        "",
        f"`python -m iterserve.loadtests.studies.ray_routing.routing_experiment` ({meta['when']}). "
        f"{meta['num_replicas']} simulated replicas (deploy `LLMReplica`, runner=simulated, "
        f"time_scale={meta['time_scale']}), {rows[0]['requests']} requests, {source}, "
        f"routing stats every {meta['period_s']} s. Engine: "
        f"`{json.dumps(meta['engine_kwargs'])}`.",
        "",
        "| router | throughput (tok/s) | TTFT p50 (s) | TTFT p99 pooled (s) | vs pow2 "
        "| TTFT p99 median of runs (s) | vs pow2 "
        "| TTFT p99 long / short (s) | ITL p99 (s) | preemptions | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["ttft_p99_s"] / base["ttft_p99_s"] if base["ttft_p99_s"] else math.nan
        med = r.get("ttft_p99_median_of_runs_s", r["ttft_p99_s"])
        base_med = base.get("ttft_p99_median_of_runs_s", base["ttft_p99_s"])
        lines.append(
            f"| {r['arm']} | {r['throughput_tok_s']:.0f} | {r['ttft_p50_s']:.3f} | "
            f"{r['ttft_p99_s']:.3f} | {ratio:.2f}x | {med:.3f} | {med / base_med:.2f}x | "
            f"{r['ttft_p99_long_s']:.3f} / "
            f"{r['ttft_p99_short_s']:.3f} | {r['itl_p99_s']:.3f} | {r['preemptions']:g} | "
            f"{r['failed']} |"
        )
    lines += ["", f"Each arm ran {meta['repeats']} time(s), in alternating order (A B C, C B A); "
              "TTFT/ITL percentiles pool every run's requests, preemptions are per-run means.",
              "", "Floors: KVAware p99 TTFT <= 0.7x pow2; KVAware preemptions <= half of pow2.",
              ""]
    for r in rows[1:]:
        pooled_ok = r["ttft_p99_s"] <= 0.7 * base["ttft_p99_s"]
        med_ok = r.get("ttft_p99_median_of_runs_s", r["ttft_p99_s"]) <= 0.7 * base.get(
            "ttft_p99_median_of_runs_s", base["ttft_p99_s"])
        pre_ok = r["preemptions"] <= base["preemptions"] / 2
        lines.append(f"- {r['arm']}: p99 TTFT floor {'met' if pooled_ok else 'MISSED'} (pooled), "
                     f"{'met' if med_ok else 'MISSED'} (median of runs); preemption floor "
                     f"{'met' if pre_ok else 'MISSED'}")
    lines += ["", "The Ray path around the engine (`ClientRecord` timestamps; dispatch: send -> "
              "engine admits; return: engine's first token -> driver), ms:", "",
              "| router | dispatch p50 / p99 | engine TTFT p50 / p99 | return p50 / p99 "
              "| prefix hit rate |", "|---|---|---|---|---|"]
    for r in rows:
        hops = [f"{r.get(f'{k}_p50_s', math.nan) * 1e3:.1f} / "
                f"{r.get(f'{k}_p99_s', math.nan) * 1e3:.1f}"
                for k in ("dispatch", "engine_ttft", "return")]
        lines.append(f"| {r['arm']} | {' | '.join(hops)} | "
                     f"{r.get('prefix_hit_rate', math.nan):.3f} |")
    lines += ["", "Per run (in execution order):", "",
              "| run | router | TTFT p50 (s) | TTFT p99 (s) | ITL p99 (s) | preemptions "
              "| 1-min load average at end (2 cores) |",
              "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(meta.get("per_run", [])):
        lines.append(f"| {i} | {r['arm']} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | "
                     f"{r['itl_p99_s']:.3f} | {r['preemptions']:g} | "
                     f"{r.get('loadavg_1m_at_end', math.nan):.1f} |")
    lines += ["", "![per-replica KV usage](routing_kv.png)", "",
              "![TTFT over time](routing_ttft.png)", ""]
    (out / "routing.md").write_text("\n".join(lines))
    (out / "routing.json").write_text(json.dumps({"meta": meta, "results": results},
                                                 default=str))

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 3 * len(results)), sharex=True,
                             squeeze=False)
    for ax, res in zip(axes[:, 0], results, strict=True):
        for rep in sorted({s["replica"] for s in res["kv"]}):
            pts = [(s["t"], s["kv_usage"]) for s in res["kv"] if s["replica"] == rep]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=rep[:8], lw=1)
        ax.axhline(0.9, color="k", ls=":", lw=0.8)
        ax.set_ylim(0, 1.02)
        ax.set_ylabel("KV usage")
        ax.set_title(res["summary"]["arm"])
    axes[-1, 0].set_xlabel("time since start (s)")
    fig.tight_layout()
    fig.savefig(out / "routing_kv.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4))
    for res in results:
        pts = sorted(res["ttfts"])
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, label=res["summary"]["arm"])
    ax.set_yscale("log")
    ax.set_xlabel("send time (s)")
    ax.set_ylabel("TTFT (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "routing_ttft.png", dpi=110)
    plt.close(fig)
    return out / "routing.md"


def pooled(runs: Sequence[dict[str, Any]], arms: Sequence[str]) -> list[dict[str, Any]]:
    """Per arm, every run's requests pooled (p99 over all of them), preemptions averaged,
    the box load the highest any run ended at; every run's (sent, TTFT) pairs, so that two
    results files can be pooled again later, and the first run's KV series for the plots."""
    out = []
    for arm in arms:
        mine = [r for r in runs if r["summary"]["arm"] == arm]
        records = [rec for r in mine for rec in r["records"]]
        summary = summarize(records, sum(r["preemptions"] for r in mine), runs=len(mine))
        if len(mine) == 1:
            summary = dict(mine[0]["summary"])
        summary["arm"] = arm
        summary["throughput_tok_s"] = sum(r["summary"]["throughput_tok_s"] for r in mine) / len(mine)
        summary["runs"] = len(mine)
        per_run = sorted(r["summary"]["ttft_p99_s"] for r in mine)
        summary["ttft_p99_median_of_runs_s"] = per_run[len(per_run) // 2] if len(per_run) % 2 \
            else (per_run[len(per_run) // 2 - 1] + per_run[len(per_run) // 2]) / 2
        loads = [r["summary"]["loadavg_1m_at_end"] for r in mine if "loadavg_1m_at_end" in r["summary"]]
        if loads:
            summary["loadavg_1m_at_end"] = max(loads)
            summary["loadavg_1m_at_end_per_run"] = loads
        out.append({"summary": summary, "kv": mine[0]["kv"],
                    "ttfts": [pair for r in mine for pair in r["ttfts"]]})
    return out


def trace_workload(args: argparse.Namespace) -> tuple[list[WorkloadRequest], dict[str, Any]]:
    """The requests of --trace for this experiment's engine, and what the results record
    of them (`sim_validation.workload_of` reads it back)."""
    from iterserve.autoscale.sim.traces import read_trace_turns, trace_digest
    from iterserve.loadtests.studies.ray_routing.ray_trace import Vocabulary, trace_specs

    requests, parents = read_trace_turns(args.trace, args.hash_block_size)
    specs = trace_specs(requests, parents, Vocabulary.of_engine(ENGINE_KWARGS),
                        args.time_scale, args.trace_speed)
    return specs, {"trace": str(args.trace), "trace_sha256": trace_digest(args.trace),
                   "hash_block_size": args.hash_block_size, "speed": args.trace_speed}


async def main_async(args: argparse.Namespace) -> int:
    if args.trace is not None:
        specs, workload = trace_workload(args)
    else:
        wl = WorkloadConfig(seed=args.seed, duration_s=args.duration,
                            num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
                            prefix_fraction=args.prefix_fraction)
        specs, workload = make_workload(wl), asdict(wl)
    engine_kwargs = {**ENGINE_KWARGS, "simulator": json.dumps({"time_scale": args.time_scale})}
    arms = [ARMS[int(i)] for i in args.arms.split(",")]
    # Alternate the order (A B C, C B A, ...) so that slow drifts in background load on a
    # shared machine hit every arm alike.
    order = [a for rep in range(args.repeats) for a in (arms if rep % 2 == 0 else arms[::-1])]
    print(f"{len(specs)} requests over {max(s.arrival_time for s in specs):.0f}s; runs: {order}",
          flush=True)
    runs = []
    for idx, arm in enumerate(order):
        runs.append(await run_arm(arm, idx, specs, args.num_replicas, engine_kwargs,
                                  args.stats_period))
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "num_replicas": args.num_replicas, "seed": args.seed, "time_scale": args.time_scale,
        "period_s": args.stats_period, "engine_kwargs": engine_kwargs,
        "workload": workload, "repeats": args.repeats,
        "per_run": [r["summary"] for r in runs],
        "router_configs": {arm: config.model_dump() for arm in arms
                           if (config := iterserve_router_config(arm, args.stats_period))},
    }
    report = write_report(pooled(runs, arms), Path(args.out), meta)
    print(report.read_text())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    parser.add_argument("--duration", type=float, default=60.0, help="workload seconds")
    parser.add_argument("--quick", action="store_true", help="20 s workload (smoke run)")
    parser.add_argument("--num-replicas", type=int, default=4, help="simulated replicas per arm")
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE,
                        help="slow-motion factor of the simulated GPU (every arm alike)")
    parser.add_argument("--stats-period", type=float, default=0.5,
                        help="seconds between the replicas' routing stats")
    parser.add_argument("--out", default=str(results_of("ray_routing")),
                        help="folder for routing.md, .json and the plots")
    parser.add_argument("--arms", default="0,1,2", help="indices into " + ", ".join(ARMS))
    parser.add_argument("--num-prefixes", type=int, default=WorkloadConfig.num_prefixes,
                        help="shared prompt prefixes (tenants' system prompts)")
    parser.add_argument("--prefix-len", type=int, default=WorkloadConfig.prefix_len,
                        help="tokens of each shared system prompt")
    parser.add_argument("--prefix-fraction", type=float,
                        default=WorkloadConfig.prefix_fraction,
                        help="share of requests that start with a shared system prompt")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per arm, in alternating order; latencies pooled")
    parser.add_argument("--trace", type=Path, default=None,
                        help="replay this trace (JSONL or CSV) in place of the generated "
                             "workload")
    parser.add_argument("--trace-speed", type=float, default=1.0,
                        help="with --trace: arrivals this many times faster than recorded")
    parser.add_argument("--hash-block-size", type=int, default=None,
                        help="with --trace: tokens per hash id (default: the trace's, else 16)")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration = 20.0
    if args.trace is not None and not args.trace.is_file():
        parser.error(f"--trace: no such file: {args.trace}")
    if not args.trace_speed > 0:
        parser.error("--trace-speed must be > 0")
    start_ray()
    try:
        return asyncio.run(main_async(args))
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
