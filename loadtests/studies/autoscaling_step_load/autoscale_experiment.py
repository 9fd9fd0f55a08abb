"""Autoscaling experiment: a low / high / low step load on simulated replicas (min 1, max 6)
scaled by `KVAutoscalingPolicy` and routed by `KVAwareRouter`.

    python -m iterserve.loadtests.studies.autoscaling_step_load.autoscale_experiment [--quick] \
        [--seed 0] [--out DIR]

Records, over time: running and starting replicas (serve.status), the autoscaler's target
(running + starting: Serve starts a replica as soon as the target rises), every replica's KV
usage and waiting queue (its record_routing_stats), and every request's outcome. Reports the
time from the step up to the first scale-up decision, to the first new replica RUNNING and to
steady state, the scale-down back to min, and the number of failed requests (must be 0: a
replica chosen for removal drains). Writes autoscale.md, autoscale.json and autoscale.png
into the study's results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from iterserve.autoscale.autoscaling_policy import autoscaling_env_vars, serve_autoscaling_config
from iterserve.autoscale.config import AutoscaleConfig, RouterConfig
from iterserve.autoscale.percentile import percentile
from iterserve.autoscale.router import request_router_config
from iterserve.autoscale.sim.arrivals import arrival_times
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.loadtests.studies import results_of
from iterserve.loadtests.studies.ray_harness import (
    DEFAULT_TIME_SCALE,
    ReplicaStatsPoller,
    drive,
    replica_app,
    start_ray,
)

ENGINE_KWARGS: dict[str, Any] = {
    "runner": "simulated",
    "max_num_seqs": 8,  # a small batch: one replica saturates at ~1 request/s
    "max_num_batched_tokens": 2048,
    "block_size": 16,
    "num_gpu_blocks_override": 512,
    "max_model_len": 4096,
}

SCALING = AutoscaleConfig(
    min_replicas=1,
    max_replicas=6,
    target_waiting_per_replica=2.0,
    kv_high_watermark=0.85,
    upscale_delay_s=1.0,
    downscale_delay_s=10.0,
    max_upscale_step=2,
    look_back_period_s=2.0,
    metrics_push_interval_s=0.5,
)


@dataclass(frozen=True)
class StepLoad:
    seed: int = 0
    low_rate: float = 0.4  # requests per second
    high_rate: float = 4.0
    low1_s: float = 20.0
    high_s: float = 60.0
    low2_s: float = 70.0
    prompt: tuple[int, int] = (128, 768)
    output: tuple[int, int] = (64, 256)
    vocab_size: int = 4096

    @property
    def step_up_at(self) -> float:
        return self.low1_s

    @property
    def step_down_at(self) -> float:
        return self.low1_s + self.high_s

    @property
    def duration_s(self) -> float:
        return self.low1_s + self.high_s + self.low2_s


def make_step_workload(cfg: StepLoad) -> list[WorkloadRequest]:
    def rate_at(t: float) -> float:
        return cfg.high_rate if cfg.step_up_at <= t < cfg.step_down_at else cfg.low_rate

    rng = random.Random(cfg.seed)
    requests: list[WorkloadRequest] = []
    for t in arrival_times(rng, rate_at, cfg.duration_s):  # contents drawn between arrivals
        prompt = [rng.randrange(5, cfg.vocab_size) for _ in range(rng.randint(*cfg.prompt))]
        requests.append(WorkloadRequest(f"as-{cfg.seed}-{len(requests)}", t, prompt,
                                        rng.randint(*cfg.output), kind="short"))
    return requests


def _counts(poller: ReplicaStatsPoller, t0: float) -> list[dict[str, float]]:
    rows = []
    for c in poller.counts:
        running = c.get("RUNNING", 0)
        starting = c.get("STARTING", 0) + c.get("UPDATING", 0) + c.get("RECOVERING", 0)
        rows.append({"t": c["t"] - t0, "running": running, "starting": starting,
                     "stopping": c.get("STOPPING", 0), "target": running + starting})
    return rows


def analyse(rows: Sequence[dict[str, float]], load: StepLoad, min_replicas: int
            ) -> dict[str, Any]:
    up, down = load.step_up_at, load.step_down_at
    first_decision = next((r["t"] for r in rows if r["t"] >= up and r["target"] > min_replicas),
                          None)
    first_running = next((r["t"] for r in rows if r["t"] >= up and r["running"] > min_replicas),
                         None)
    high = [r for r in rows if up <= r["t"] < down]
    steady_t, peak = None, 0
    if high:
        peak = max(r["target"] for r in high)
        final = high[-1]["target"]
        last_change = up
        for prev, cur in zip(high, high[1:], strict=False):
            if (cur["target"], cur["running"]) != (prev["target"], prev["running"]):
                last_change = cur["t"]
        steady_t = last_change if high[-1]["running"] == final else None
    back_to_min = next((r["t"] for r in rows if r["t"] >= down and r["target"] <= min_replicas
                        and r["running"] <= min_replicas), None)
    return {
        "time_to_first_scale_up_decision_s": None if first_decision is None
        else first_decision - up,
        "time_to_first_new_replica_running_s": None if first_running is None
        else first_running - up,
        "time_to_steady_state_s": None if steady_t is None else steady_t - up,
        "peak_replicas": peak,
        "time_from_step_down_to_min_s": None if back_to_min is None else back_to_min - down,
    }


def write_report(result: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    s, meta, load = result["summary"], result["meta"], StepLoad(**result["meta"]["load"])

    def fmt(v: Any) -> str:  # noqa: ANN401
        return "n/a" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)

    floor_ok = (s["time_to_first_new_replica_running_s"] is not None
                and s["time_to_first_new_replica_running_s"] <= 15.0)
    lines = [
        "# Autoscaling experiment: step load on simulated replicas",
        "",
        f"`python -m iterserve.loadtests.studies.autoscaling_step_load.autoscale_experiment` "
        f"({meta['when']}). Load "
        f"{load.low_rate}/s for {load.low1_s:.0f} s, {load.high_rate}/s for {load.high_s:.0f} s, "
        f"{load.low_rate}/s for {load.low2_s:.0f} s; {s['requests']} requests. Simulated "
        f"replicas (deploy `LLMReplica`, runner=simulated, time_scale={meta['time_scale']}), "
        f"KVAwareRouter, KVAutoscalingPolicy `{json.dumps(meta['scaling'])}`.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| step up -> first scale-up decision (s) | {fmt(s['time_to_first_scale_up_decision_s'])} |",
        f"| step up -> first new replica RUNNING (s) | "
        f"{fmt(s['time_to_first_new_replica_running_s'])} |",
        f"| step up -> steady state (s) | {fmt(s['time_to_steady_state_s'])} |",
        f"| peak replicas | {s['peak_replicas']} |",
        f"| step down -> back to min replicas (s) | {fmt(s['time_from_step_down_to_min_s'])} |",
        f"| requests / failed | {s['requests']} / {s['failed']} |",
        f"| TTFT p50 / p99 (s) | {s['ttft_p50_s']:.3f} / {s['ttft_p99_s']:.3f} |",
        "",
        f"Floor: first new replica within 15 s of the step: {'met' if floor_ok else 'MISSED'}; "
        f"zero failed requests: {'met' if s['failed'] == 0 else 'MISSED'}.",
        "",
        "![replicas, KV usage and waiting over time](autoscale.png)",
        "",
    ]
    (out / "autoscale.md").write_text("\n".join(lines))
    (out / "autoscale.json").write_text(json.dumps(result))

    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    rows = result["counts"]
    ts = [r["t"] for r in rows]
    axes[0].step(ts, [r["target"] for r in rows], where="post", label="target (running+starting)")
    axes[0].step(ts, [r["running"] for r in rows], where="post", label="running")
    axes[0].set_ylabel("replicas")
    for ax in axes:
        ax.axvspan(load.step_up_at, load.step_down_at, color="orange", alpha=0.08)
    axes[0].legend(loc="upper right")
    by_rep: dict[str, list[tuple[float, float, float]]] = {}
    for smp in result["stats"]:
        by_rep.setdefault(smp["replica"], []).append((smp["t"], smp["kv_usage"],
                                                      smp["num_waiting"]))
    for rep, pts in sorted(by_rep.items()):
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], lw=1, label=rep[:8])
        axes[2].plot([p[0] for p in pts], [p[2] for p in pts], lw=1)
    axes[1].axhline(SCALING.kv_high_watermark, color="k", ls=":", lw=0.8)
    axes[1].set_ylabel("KV usage")
    axes[2].set_ylabel("waiting")
    axes[2].set_xlabel("time since start (s)")
    fig.tight_layout()
    fig.savefig(out / "autoscale.png", dpi=110)
    plt.close(fig)
    return out / "autoscale.md"


async def run(load: StepLoad, scaling: AutoscaleConfig, engine_kwargs: dict[str, Any],
              time_scale: float, app_name: str = "autoscale",
              max_ongoing_requests: int = 24) -> dict[str, Any]:
    from ray import serve

    specs = make_step_workload(load)
    app = replica_app(
        engine_kwargs,
        router=request_router_config(RouterConfig(prefix_affinity=False)),
        autoscaling=serve_autoscaling_config(scaling),
        drain_timeout_s=60.0,
        # Bounded per replica: the backlog waits in Serve's handle queue (which the policy
        # counts as waiting) and is routed to new replicas as they come up, instead of
        # sitting in the first replica's engine queue.
        max_ongoing_requests=max_ongoing_requests,
    )
    handle = await asyncio.to_thread(serve.run, app, name=app_name, route_prefix=None)
    poller = ReplicaStatsPoller(app_name, period_s=0.5)
    poller.start()
    t0, records = await drive(handle, specs)
    # keep observing until the deployment is back at min (or a bound)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        if poller.counts and poller.counts[-1].get("RUNNING", 0) <= scaling.min_replicas \
                and not poller.counts[-1].get("STOPPING", 0) \
                and time.monotonic() - t0 > load.duration_s:
            break
    await poller.stop()
    await asyncio.wait_for(asyncio.to_thread(serve.delete, app_name), 180)
    rows = _counts(poller, t0)
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    summary = {"requests": len(records), "failed": len(records) - len(ok),
               "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
               **analyse(rows, load, scaling.min_replicas)}
    errors = sorted({r.error or str(r.finish_reason) for r in records if not r.ok})[:5]
    return {
        "summary": summary,
        "errors": errors,
        "counts": rows,
        "stats": [{"t": s["t"] - t0, "replica": s["replica"], "kv_usage": s["kv_usage"],
                   "num_waiting": s["num_waiting"]} for s in poller.samples],
        "meta": {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "time_scale": time_scale, "scaling": scaling.model_dump(),
                 "engine_kwargs": engine_kwargs, "load": asdict(load)},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of the step-load workload")
    parser.add_argument("--quick", action="store_true", help="shorter phases (smoke run)")
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE,
                        help="slow-motion factor of the simulated GPU (every arm alike)")
    parser.add_argument("--out", default=str(results_of("autoscaling_step_load")),
                        help="folder for autoscale.md, .json and .png")
    args = parser.parse_args(argv)
    load = StepLoad(seed=args.seed)
    if args.quick:
        load = StepLoad(seed=args.seed, low1_s=10, high_s=30, low2_s=40)
    start_ray(autoscaling_env_vars(SCALING))
    engine = {**ENGINE_KWARGS, "simulator": json.dumps({"time_scale": args.time_scale})}
    try:
        result = asyncio.run(run(load, SCALING, engine, args.time_scale))
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    report = write_report(result, Path(args.out))
    print(report.read_text())
    if result["errors"]:
        print("errors:", result["errors"])
    return 0 if result["summary"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
