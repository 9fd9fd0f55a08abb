"""The engine's own CPU time per step on the simulated runner, which its cost model leaves out.

    python -m iterserve.loadtests.studies.sim_validation.engine_cpu_overhead [--running 1 8 16 32 \
        40] [--rounds 3]

The simulated runner sleeps each step's modelled GPU time; with async scheduling off (its
default: nothing runs apart from the CPU) the engine's scheduling, input preparation,
sampling and output processing happen between those sleeps, so every real step lasts the
modelled time plus that CPU time. The cluster simulator's replicas take no CPU time at all.
When it replays a Ray run of the simulated engine (`sim_validation`), that difference is
real: pow2's p99 TTFT moves ~25 % per 2 ms added to every step (its queues run near the
edge), a KV-aware router's ~2 %.

This measures it in one process (no Ray, no token streaming: a lower bound for a Ray
replica on a shared box): engine wall time per step minus modelled time per step with n
decodes running (offline_bench.async_step_time, median of `rounds`), and fits
excess = per_step + per_seq * n by least squares. Writes
loadtests/studies/sim_validation/results/engine_cpu_overhead.json, which `sim_validation --engine-cpu` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iterserve.loadtests.studies import results_of


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points; ValueError (the
    stdlib's StatisticsError) unless the xs take two or more values."""
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def measure(running: Sequence[int], rounds: int, steps: int) -> dict[str, Any]:
    from iterserve.loadtests.studies.engine_speed.offline_bench import async_step_time

    points = []
    for n in running:
        excess = [wall - modelled for wall, modelled in
                  (async_step_time(False, num_running=n, steps=steps) for _ in range(rounds))]
        points.append({"running": n, "excess_s": statistics.median(excess),
                       "excess_s_per_round": excess})
    per_step, per_seq = fit_line([p["running"] for p in points], [p["excess_s"] for p in points])
    return {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "loadavg_1m": os.getloadavg()[0], "rounds": rounds, "steps": steps,
            "points": points, "per_step_s": per_step, "per_seq_s": per_seq}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, nargs="+", default=[1, 8, 16, 32, 40],
                        help="running requests to measure the step's CPU time at")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds per point (their median is reported)")
    parser.add_argument("--steps", type=int, default=60, help="engine steps per round")
    parser.add_argument("--out", type=Path, default=results_of("sim_validation") / "engine_cpu_overhead.json",
                        help="where the JSON goes (sim_validation --engine-cpu reads it)")
    args = parser.parse_args(argv)
    result = measure(args.running, args.rounds, args.steps)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for p in result["points"]:
        print(f"{p['running']:4d} running: {p['excess_s'] * 1e3:.2f} ms per step beyond the model "
              f"(rounds {', '.join(f'{x * 1e3:.2f}' for x in p['excess_s_per_round'])})")
    print(f"fit: {result['per_step_s'] * 1e3:.3f} ms per step + "
          f"{result['per_seq_s'] * 1e3:.4f} ms per running sequence; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
