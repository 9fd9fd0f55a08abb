"""`iterserve bench`: static vs continuous batching on the same model and seeded workload.

It starts `iterserve serve --batching static` and `--batching continuous` side by side on
free local ports (or uses --static-url / --continuous-url), then runs closed-loop levels of
concurrency 1, 4, 16, 64, 128. Each level sends the same first N requests of the workload to
both modes, back to back (alternating which goes first, so background load on a shared
machine hits both alike), and records TTFT, TPOT, ITL, output tokens/s, goodput and the
KV-cache watermark sampled from GET /metrics. It writes results JSON, BENCHMARKS_SERVING.md
and PNG plots.

    iterserve bench                                  # the full run (about 15 min on 2 cores)
    iterserve bench --quick                          # concurrency 1, 4, 16; a minute or two
    iterserve bench --concurrency 1,8,64 --goodput ttft:2000 tpot:100 \
        --serve-args="--max-num-seqs 128" --out /tmp/bench --report /tmp/bench/REPORT.md
    iterserve bench --static-url http://127.0.0.1:8001 --continuous-url http://127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm import tqdm

from iterserve.autoscale.sim.workload import OutputLengths, WorkloadRequest, make_workload
from iterserve.loadtests import bench_report
from iterserve.loadtests.bench_client import MetricsSampler, NvmlSampler, run_level
from iterserve.loadtests.bench_stats import compare, parse_slo, summarise_level
from iterserve.loadtests.servers import (
    Terminated,
    serve_mode,
    until_terminated,
    wait_until_ready,
)
from iterserve.loadtests.workload import add_workload_arguments

DEFAULT_CONCURRENCY = (1, 4, 16, 64, 128)
QUICK_CONCURRENCY = (1, 4, 16)
FLOOR_CONCURRENCY = 64


def requests_for_level(concurrency: int, args: argparse.Namespace) -> int:
    return max(args.min_requests, min(args.max_requests, args.requests_per_slot * concurrency))


@dataclass
class Deployment:
    """One mode's server during a run."""

    mode: str
    url: str
    info: dict[str, Any]
    sampler: MetricsSampler
    levels: list[dict[str, Any]] = field(default_factory=list)

    @property
    def model(self) -> str:
        return str(self.info["id"])


async def _run_one_level(deployment: Deployment, concurrency: int,
                         requests: list[WorkloadRequest], origin: float,
                         args: argparse.Namespace) -> None:
    with tqdm(total=len(requests), desc=f"{deployment.mode:>10} c={concurrency:<3}",
              unit="req", leave=True, disable=args.no_progress) as bar:
        run = await run_level(deployment.url, deployment.model, requests, concurrency,
                              args.api_key, on_done=lambda _: bar.update(1))
    await asyncio.sleep(args.sample_interval * 2)  # a sample after the level ends
    summary = summarise_level(run, deployment.sampler.samples, parse_slo(args.goodput))
    summary["t_start"] = run.started_at - origin
    summary["t_end"] = run.finished_at - origin
    deployment.levels.append(summary)


async def run_interleaved(deployments: list[Deployment], workload: list[WorkloadRequest],
                          args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each concurrency level runs on every mode back to back, alternating which goes first,
    so slow drifts in background load (a shared machine) hit both modes alike."""
    warmup = [WorkloadRequest(f"warmup-{i}", 0.0, r.prompt_token_ids[:16], 8, kind="warmup")
              for i, r in enumerate(workload[:2])]
    for deployment in deployments:
        await run_level(deployment.url, deployment.model, warmup, 2, args.api_key)
        deployment.sampler.start()
    origin = time.perf_counter()
    for index, concurrency in enumerate(args.concurrency):
        requests = workload[:requests_for_level(concurrency, args)]
        for deployment in deployments if index % 2 == 0 else deployments[::-1]:
            await _run_one_level(deployment, concurrency, requests, origin, args)
    results = {}
    for deployment in deployments:
        await deployment.sampler.stop()
        samples = [{**asdict(s), "t": s.t - origin} for s in deployment.sampler.samples
                   if s.t >= origin]
        results[deployment.mode] = {"url": deployment.url, "levels": deployment.levels,
                                    "samples": samples, "server": deployment.info.get("metadata", {}),
                                    "sampler_errors": deployment.sampler.errors}
    return results


def _environment(info: dict[str, Any]) -> dict[str, Any]:
    nvml = NvmlSampler()
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(),
            "gpu": "NVML available" if nvml.available else "none (CPU run)",
            "model": info.get("id"), "server_metadata": info.get("metadata", {})}


def _key_value(text: str) -> tuple[str, str]:
    key, separator, value = text.partition("=")
    if not separator or not key:
        raise argparse.ArgumentTypeError(f"want KEY=VALUE, got {text!r}")
    return key, value


def wait_for_quiet_machine(max_load: float, timeout_s: float) -> float:
    """Block until the 1-minute load average drops to `max_load` (or time runs out)."""
    deadline = time.monotonic() + timeout_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(5.0)
    return os.getloadavg()[0]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iterserve bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=lambda s: tuple(int(x) for x in s.split(",")),
                        default=None, help="comma-separated levels (default 1,4,16,64,128)")
    parser.add_argument("--quick", action="store_true",
                        help="levels 1,4,16 and fewer requests: a smoke run")
    parser.add_argument("--modes", default="static,continuous",
                        help="comma-separated batching modes to run side by side (static, continuous)")
    parser.add_argument("--static-url", default=None, help="use this server for static")
    parser.add_argument("--continuous-url", default=None, help="use this server for continuous")
    parser.add_argument("--serve-args", default="",
                        help="extra `iterserve serve` flags for both modes, one string; use "
                             "the = form: --serve-args='--max-num-seqs 128'")
    parser.add_argument("--serve-env", action="append", default=[], type=_key_value,
                        metavar="KEY=VALUE", help="environment for the started servers "
                        "(repeatable); the simulated GPU is an engine flag: "
                        "--serve-args=\"--simulate --simulator '{\\\"time_scale\\\": 12}'\"")
    parser.add_argument("--wait-for-load", type=float, default=None, metavar="LOAD",
                        help="before each mode, wait until the 1-minute load average is at "
                             "most LOAD (a shared machine), for up to --wait-timeout-s")
    parser.add_argument("--wait-timeout-s", type=float, default=600.0,
                        help="with --wait-for-load: give up waiting for a quiet machine after this")
    parser.add_argument("--api-key", default=os.environ.get("ITERSERVE_API_KEY"),
                        help="Bearer key for the servers (default: $ITERSERVE_API_KEY)")
    parser.add_argument("--requests-per-slot", type=int, default=2,
                        help="requests per level = this x concurrency, within the bounds below")
    parser.add_argument("--min-requests", type=int, default=16,
                        help="fewest requests a concurrency level sends")
    parser.add_argument("--max-requests", type=int, default=256,
                        help="most requests a concurrency level sends")
    parser.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:100"],
                        metavar="NAME:MS", help="SLOs for goodput (ttft, tpot, e2e; ms)")
    parser.add_argument("--sample-interval", type=float, default=0.5,
                        help="seconds between /metrics samples")
    parser.add_argument("--out", type=Path, default=bench_report.RESULTS,
                        help="folder for bench.json and the plots")
    parser.add_argument("--report", type=Path, default=Path("BENCHMARKS_SERVING.md"),
                        help="where the markdown report is written")
    parser.add_argument("--log-dir", type=Path, default=Path("runs/bench"),
                        help="server logs of the deployments bench starts")
    parser.add_argument("--check-floors", action="store_true",
                        help="exit 1 unless continuous >= 2x static tokens/s and >= 40%% lower "
                             "p95 TTFT at concurrency 64")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    parser.add_argument("--note", action="append", default=[],
                        help="a line for the report's Notes section (repeatable)")
    add_workload_arguments(parser)
    return parser


def _apply_quick(args: argparse.Namespace) -> None:
    if args.concurrency is None:
        args.concurrency = QUICK_CONCURRENCY if args.quick else DEFAULT_CONCURRENCY
    if args.quick:
        args.min_requests = min(args.min_requests, 8)
        args.max_requests = min(args.max_requests, 32)
        if args.output_lengths == OutputLengths():
            args.output_lengths = OutputLengths.exponential(64, 8, 128)


def _program() -> str:
    """How this run was started, for the report (the console script or the module)."""
    if Path(sys.argv[0]).name == "iterserve":
        return "iterserve bench"
    return "python -m iterserve.loadtests.bench"


def _note_busy_machine(results: dict[str, Any]) -> None:
    """Record the 1-minute load average (servers up, before and after the levels); note it
    when other processes share the machine."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    moment = "after" if results["load_average"] else "before"
    results["load_average"][moment] = load
    if load > cores + 1:  # the two idle servers and this client account for about 1
        results["notes"].append(f"1-minute load average {load:.1f} on {cores} cores {moment} "
                                "the levels: other processes were using the machine")


def run_benchmark(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    _apply_quick(args)
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    workload = make_workload(requests_for_level(max(args.concurrency), args), args.seed,
                             prompt_buckets=args.prompt_buckets,
                             output_lengths=args.output_lengths, vocab_size=args.vocab_size)
    urls = {"static": args.static_url, "continuous": args.continuous_url}
    results: dict[str, Any] = {
        "command": f"{_program()} {shlex.join(argv)}".strip(),
        "started_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "concurrency": list(args.concurrency), "floor_concurrency": FLOOR_CONCURRENCY,
        "serve_args": shlex.split(args.serve_args), "serve_env": dict(args.serve_env),
        "slo": parse_slo(args.goodput).describe(),
        "sample_interval_s": args.sample_interval,
        "workload": {"seed": args.seed,
                     "prompt_buckets": ", ".join(f"{b.name} {b.low}-{b.high} ({b.weight:g})"
                                                 for b in args.prompt_buckets),
                     "output_lengths": asdict(args.output_lengths),
                     "requests_per_level": {c: requests_for_level(c, args)
                                            for c in args.concurrency}},
        "modes": {}, "environment": {}, "notes": list(args.note), "load_average": {},
    }
    with ExitStack() as stack:
        deployments = []
        if args.wait_for_load is not None:  # Ray's startup times out on an overloaded box
            wait_for_quiet_machine(args.wait_for_load, args.wait_timeout_s)
        for mode in modes:
            if urls.get(mode):
                url = urls[mode]
                info = wait_until_ready(url, None, None, args.api_key, timeout_s=30)
            else:
                url, info = stack.enter_context(serve_mode(
                    mode, shlex.split(args.serve_args), args.log_dir, args.api_key,
                    dict(args.serve_env)))
            deployments.append(Deployment(mode, url, info,
                                          MetricsSampler(url, args.sample_interval)))
        if args.wait_for_load is not None:
            wait_for_quiet_machine(args.wait_for_load, args.wait_timeout_s)
        _note_busy_machine(results)
        results["modes"] = asyncio.run(until_terminated(
            run_interleaved(deployments, workload, args)))
        _note_busy_machine(results)
        results["environment"] = _environment(deployments[0].info)
    return results


def main(argv: list[str] | None = None) -> int:
    """static vs continuous batching over HTTP on one seeded workload"""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        results = run_benchmark(args, argv)
    except Terminated as stop:  # its servers were stopped on the way out (servers.py)
        print(f"iterserve bench: {stop}: stopped, and the servers it started", file=sys.stderr)
        return 128 + stop.signum
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "bench.json"
    results["json_path"] = str(json_path)
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    report = bench_report.write_report(results, args.report, args.out)
    floor = compare(results["modes"].get("static", {}).get("levels", []),
                    results["modes"].get("continuous", {}).get("levels", []), FLOOR_CONCURRENCY)
    print(f"wrote {json_path}, {report} and plots in {args.out}")
    if floor.throughput_ratio is not None and floor.ttft_p95_reduction is not None:
        print(f"c={FLOOR_CONCURRENCY}: continuous/static tokens/s {floor.throughput_ratio:.2f}x, "
              f"p95 TTFT {floor.ttft_p95_reduction * 100:.0f}% lower -> "
              f"{'PASS' if floor.passed else 'FAIL'}")
    return 1 if args.check_floors and not floor.passed else 0


if __name__ == "__main__":
    sys.exit(main())
