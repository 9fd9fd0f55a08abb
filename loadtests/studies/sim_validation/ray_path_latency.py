"""The Ray Serve path's own per-request latency, measured around the engine.

    python -m iterserve.loadtests.studies.sim_validation.ray_path_latency [--requests 120] [--time-scale 5]

The cluster simulator models a request from the moment its replica's engine admits it to
its tokens leaving the engine. On the real path (the routing experiment: a driver's
DeploymentHandle, deploy's `LLMReplica` actors, runner=simulated) a request also spends
  dispatch: the handle's routing (queue-length probe or stats read), the actor call and
            the replica's event loop (driver send -> the replica calls its engine, which
            stamps the request's arrival_time; the wait for a busy engine's current step
            comes after, inside the engine's TTFT, as in the simulator);
  return:   the engine's output reaching the replica's event loop and the streaming
            generator's hop back to the driver (engine first token -> driver receives it).
Both come from timestamps (CLOCK_MONOTONIC is shared by every process on the machine):
`ClientRecord.dispatch_latency` / `.return_latency` in `ray_harness`.

This probe measures them where nothing queues: the experiment's 4 replicas and engine
settings, one request at a time (an idle replica, no batch mates), short prompts without
shared prefixes. It also compares the engine's own TTFT with the cost model's prefill step
(x time_scale): the excess is the engine's CPU time per step that the simulated GPU's
sleep does not hide. Writes ray_path_latency.json and .md into the study's results/; the
medians are what `sim_validation` feeds the simulator (`ClusterSimConfig.dispatch_latency_s`,
`.stream_latency_s`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iterserve.autoscale.percentile import percentile
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.loadtests.studies import results_of
from iterserve.loadtests.studies.ray_harness import (
    ClientRecord,
    drive,
    hop_summary,
    quantiles,
    replica_app,
    start_ray,
)

DEFAULT_OUT = results_of("sim_validation") / "ray_path_latency.json"


def probe_specs(num_requests: int, gap_s: float, seed: int, max_tokens: int,
                prompt_range: tuple[int, int], vocab_size: int = 4096) -> list[WorkloadRequest]:
    """Requests `gap_s` apart (longer than each one takes), unique random prompts."""
    rng = random.Random(seed)
    return [WorkloadRequest(f"probe-{seed}-{i}", i * gap_s,
                            [rng.randrange(5, vocab_size) for _ in range(rng.randint(*prompt_range))],
                            max_tokens, kind="short")
            for i in range(num_requests)]


def engine_excess(records: Sequence[ClientRecord], time_scale: float) -> dict[str, float]:
    """Engine TTFT minus the cost model's one prefill step (x time_scale), and decode gaps
    minus the cost model's one-sequence decode step, at one request in flight."""
    from iterserve.replica.sim_runner import CostModel

    cost = CostModel()
    prefill_excess = []
    decode_excess = []
    for r in records:
        if r.engine_ttft is None:
            continue
        n = r.prompt_tokens
        prefill_excess.append(r.engine_ttft - cost.step_time(n, 0, n) * time_scale)
        for i, gap in enumerate(r.gaps):
            # gap i ends the step that samples output token i + 1 (context n + i + 1)
            decode_excess.append(gap - cost.step_time(0, 1, n + i + 1) * time_scale)
    return {**quantiles(prefill_excess, "engine_prefill_excess"),
            **quantiles(decode_excess, "decode_gap_excess")}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from ray import serve

    from iterserve.loadtests.studies.ray_routing.routing_experiment import ENGINE_KWARGS

    engine_kwargs = {**ENGINE_KWARGS, "simulator": json.dumps({"time_scale": args.time_scale})}
    handle = await asyncio.to_thread(
        serve.run, replica_app(engine_kwargs, num_replicas=args.num_replicas),
        name="raypath", route_prefix=None)
    # Warm-up: the first calls of a handle resolve the deployment and open connections.
    await drive(handle, probe_specs(8, 0.0, args.seed + 1000, 4, (16, 32)))
    load_before = os.getloadavg()
    _, records = await drive(handle, probe_specs(args.requests, args.gap, args.seed,
                                                 args.max_tokens, (64, 384)))
    load_after = os.getloadavg()
    await asyncio.wait_for(asyncio.to_thread(serve.delete, "raypath"), 180)
    failed = [r for r in records if not r.ok]
    ttft = [r.ttft for r in records if r.ttft is not None]
    return {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m iterserve.loadtests.studies.sim_validation.ray_path_latency " + " ".join(
            sys.argv[1:]),
        "requests": len(records), "failed": len(failed), "time_scale": args.time_scale,
        "num_replicas": args.num_replicas, "gap_s": args.gap, "max_tokens": args.max_tokens,
        "loadavg_before": load_before, "loadavg_after": load_after,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        **hop_summary(records), **engine_excess(records, args.time_scale),
    }


def write_markdown(result: dict[str, Any], path: Path) -> None:
    rows = [("dispatch (handle call -> the engine is called)", "dispatch"),
            ("engine TTFT", "engine_ttft"),
            ("engine TTFT - cost-model prefill step", "engine_prefill_excess"),
            ("return (engine first token -> driver)", "return"),
            ("decode gap - cost-model decode step", "decode_gap_excess")]
    lines = [
        "# The Ray Serve path's own per-request latency (one request in flight)", "",
        f"`{result['command']}` ({result['when']}): {result['requests']} requests "
        f"({result['failed']} failed), one at a time, {result['gap_s']} s apart, "
        f"{result['num_replicas']} replicas, routing experiment engine, time_scale "
        f"{result['time_scale']}, unique prompts of 64-384 tokens, {result['max_tokens']} "
        f"output tokens. Box load average (1/5/15 min, 2 cores): before "
        f"{'/'.join(f'{x:.1f}' for x in result['loadavg_before'])}, after "
        f"{'/'.join(f'{x:.1f}' for x in result['loadavg_after'])}.", "",
        "| segment | p10 (ms) | p50 (ms) | p90 (ms) | p99 (ms) |", "|---|---|---|---|---|",
    ]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(
            f"{result[f'{key}_p{q}_s'] * 1e3:.1f}" for q in (10, 50, 90, 99)) + " |")
    lines += ["", f"Driver-side TTFT p50 {result['ttft_p50_s'] * 1e3:.1f} ms, p99 "
              f"{result['ttft_p99_s'] * 1e3:.1f} ms.", ""]
    path.with_suffix(".md").write_text("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=120, help="requests, one in flight at a time")
    parser.add_argument("--gap", type=float, default=1.0,
                        help="seconds between sends (longer than one request takes)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each request generates")
    parser.add_argument("--num-replicas", type=int, default=4, help="simulated replicas")
    parser.add_argument("--time-scale", type=float, default=5.0,
                        help="slow-motion factor of the simulated GPU")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="where the JSON goes (and the .md beside it)")
    args = parser.parse_args(argv)
    start_ray()
    try:
        result = asyncio.run(measure(args))
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    args.out.write_text(json.dumps(result, indent=1))
    write_markdown(result, args.out)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
