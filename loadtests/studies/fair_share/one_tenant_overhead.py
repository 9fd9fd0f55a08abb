"""Work-conserving: does one tenant alone under the fair policy get FCFS's throughput?

The real scheduler and block manager with the null runner (no model: what is timed is the
scheduling work, the only place the policies differ), one tenant sending the same requests
under fcfs and fair, rounds alternating; reports requests per second of scheduling time and
that the admission order was identical. Then the whole engine with the simulated runner
(the calibrated cost model, which sleeps each step's modelled time, as a GPU would take it):
the same one-tenant workload's requests per second of wall time, rounds alternating.

    python -m iterserve.loadtests.studies.fair_share.one_tenant_overhead --rounds 6
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

from iterserve.replica.block_manager import BlockManager
from iterserve.replica.config import EngineConfig, SchedulerConfig
from iterserve.replica.llm_engine import LLMEngine
from iterserve.replica.null_runner import NullRunner
from iterserve.replica.request import Request, TenantShare
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.scheduler import Scheduler

HERE = Path(__file__).resolve().parent


def one_round(policy: str, num_requests: int) -> tuple[float, list[str]]:
    """(seconds of scheduling, the admission order) of one tenant's requests run to the end."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=1024,
                        scheduler_policy=policy),
        BlockManager(4096, 16, enable_prefix_caching=False), clock=time.monotonic)
    runner = NullRunner(4096)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        scheduler.add_request(Request(f"r{i}", [3] * (64 + i % 200), params, float(i),
                                      tenant="solo"))
    order: list[str] = []
    seen: set[str] = set()
    start = time.perf_counter()
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        for planned in output.scheduled:
            if planned.request.request_id not in seen:
                seen.add(planned.request.request_id)
                order.append(planned.request.request_id)
        scheduler.update(output, runner.execute(output))
    return time.perf_counter() - start, order


def engine_round(policy: str, num_requests: int) -> float:
    """Seconds of wall time the simulated-runner engine takes to serve one tenant's
    requests (all queued at once) under `policy`."""
    engine = LLMEngine(EngineConfig.from_kwargs(
        runner="simulated", max_model_len=1024, max_num_seqs=64, num_gpu_blocks_override=4096,
        scheduler_policy=policy))
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request([3 + i % 50] * (64 + i % 200), params, tenant=TenantShare("solo"))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds per policy")
    parser.add_argument("--requests", type=int, default=2000, help="requests per round")
    parser.add_argument("--engine-requests", type=int, default=300,
                        help="requests per round of the simulated-runner engine")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "one_tenant.json",
                        help="where the figures are written")
    args = parser.parse_args(argv)
    seconds: dict[str, list[float]] = {"fcfs": [], "fair": []}
    orders: dict[str, list[str]] = {}
    for _, policy in itertools.product(range(args.rounds), ("fcfs", "fair")):
        elapsed, orders[policy] = one_round(policy, args.requests)
        seconds[policy].append(elapsed)
    engine_seconds: dict[str, list[float]] = {"fcfs": [], "fair": []}
    for _, policy in itertools.product(range(args.rounds), ("fcfs", "fair")):
        engine_seconds[policy].append(engine_round(policy, args.engine_requests))
    engine_rate = {p: args.engine_requests / statistics.median(s)
                   for p, s in engine_seconds.items()}
    rate = {p: args.requests / statistics.median(s) for p, s in seconds.items()}
    summary = {"requests": args.requests, "rounds": args.rounds,
               "requests_per_s_median": {p: round(r, 1) for p, r in rate.items()},
               "fair_over_fcfs": round(rate["fair"] / rate["fcfs"], 4),
               "same_admission_order": orders["fair"] == orders["fcfs"],
               "engine_requests": args.engine_requests,
               "engine_requests_per_s_median": {p: round(r, 2) for p, r in engine_rate.items()},
               "engine_fair_over_fcfs": round(engine_rate["fair"] / engine_rate["fcfs"], 4),
               "seconds": seconds, "engine_seconds": engine_seconds}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if "seconds" not in k}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
