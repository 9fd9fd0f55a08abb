"""Offline engine benchmark: prints figures, asserts nothing (floors live in BENCHMARKS.md).

    python -m iterserve.loadtests.studies.engine_speed.offline_bench                  # every part, \
        built-in model
    python -m iterserve.loadtests.studies.engine_speed.offline_bench --part sched     # scheduler \
        overhead only
    python -m iterserve.loadtests.studies.engine_speed.offline_bench --part async     # async vs \
        sync, simulated GPU

1. Scheduler + input preparation time per step at 64, 256 and 1024 running requests, over
   the null runner (no model): what the engine itself costs per iteration. Reported as this
   thread's CPU time (what the work costs) and as wall time (which on a shared machine also
   counts the time other processes held the core).
1b. Engine step time with async scheduling off and on, on the simulated runner (its GPU time
   is modelled; the engine's CPU work is real), against the modelled GPU time per step.
2. Offline throughput on one seeded mixed workload with token-id prompts (prompts short 16-64
   / medium 128-384 / long 512-1024 tokens at 0.5/0.3/0.2; outputs exponential mean 128 capped
   to [8, 512]; ignore_eos), default 64 requests 32 concurrent, fp32, on the built-in
   SmolLM2-135M-Instruct: iterserve continuous and static, HF transformers `generate` in padded
   batches, and transformers' continuous batching, side by side. The contenders alternate
   (A B C D, A B C D, ...) so that noise from other processes hits all alike; best and median
   tokens/s per contender are reported, with the threads each computed on, and iterserve
   continuous over each (ratio of medians, and the range of the per-round ratios). With
   --vllm-python, vLLM's CPU build joins them from its own venv (offline_bench_vllm_peer.py),
   with its default thread binding and with its compute threads bound to every core. --once
   runs the named contenders in the last round only (the HF ones take ~31 minutes a round;
   last, so the cheap contenders' alternating rounds are in before the long ones start).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from iterserve.autoscale.sim.workload import LengthBucket, OutputLengths
from iterserve.loadtests.studies.engine_speed.cpu_paths_bench import cpu_model_name
from iterserve.loadtests.studies.engine_speed.offline_bench_hf import (
    ThroughputResult,
    hf_continuous,
    hf_generate,
    load_hf_model,
)
from iterserve.loadtests.studies.engine_speed.offline_bench_vllm_peer import (
    VllmSetup,
    prepare_vllm_inputs,
    vllm_cpu,
)
from iterserve.replica.block_manager import BlockManager
from iterserve.replica.config import EngineConfig, SchedulerConfig
from iterserve.replica.input_batch import prepare_inputs
from iterserve.replica.llm import LLM
from iterserve.replica.llm_engine import LLMEngine
from iterserve.replica.model_source import resolve_model_path
from iterserve.replica.null_runner import NullRunner
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.scheduler import Scheduler

if TYPE_CHECKING:
    from iterserve.autoscale.sim.workload import WorkloadRequest


# ---------------------------------------------------------------------------- part 1
def scheduler_step_time(num_running: int, steps: int = 50, block_size: int = 16,
                        clock: Callable[[], float] = time.thread_time) -> float:
    """Median seconds of schedule() + prepare_inputs() + update() with num_running decodes."""
    prompt_len, max_tokens = 128, 10_000
    blocks = num_running * ((prompt_len + steps + 64) // block_size + 2)
    manager = BlockManager(blocks, block_size, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=8192,
                             max_model_len=prompt_len + max_tokens)
    scheduler = Scheduler(config, manager)
    runner = NullRunner(blocks, vocab_size=32_000)
    for i in range(num_running):
        prompt = [(i * 131 + j * 7) % 32_000 for j in range(prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens,
                                                                      ignore_eos=True), 0.0))
    while not scheduler.all_running_have_output() or scheduler.num_waiting:
        output = scheduler.schedule()
        scheduler.update(output, runner.execute(output))
    times = []
    for _ in range(steps):
        start = clock()
        output = scheduler.schedule()
        prepare_inputs(output, block_size)
        before_runner = clock()
        sampled = runner.execute(output)  # the model's part: excluded from the timing
        after_runner = clock()
        scheduler.update(output, sampled)
        end = clock()
        times.append((before_runner - start) + (end - after_runner))
    return statistics.median(times)


def async_step_time(async_scheduling: bool, num_running: int = 256,
                    steps: int = 40) -> tuple[float, float]:
    """(engine wall seconds per step, modelled GPU seconds per step) for num_running decodes
    on the simulated runner (H100 cost model, time_scale 1), detokenization included."""
    engine = LLMEngine(EngineConfig.from_kwargs(
        runner="simulated", async_scheduling=async_scheduling, max_num_seqs=num_running,
        max_model_len=2048, enable_prefix_caching=False))
    for i in range(num_running):
        prompt = [(i * 131 + j * 7) % 4000 + 1 for j in range(128)]
        engine.add_request(prompt, SamplingParams(max_tokens=10_000, ignore_eos=True))
    while not engine.scheduler.all_running_have_output() or engine.scheduler.num_waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    runner = engine.runner
    modelled_before = runner.total_simulated_s
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    return wall / steps, (runner.total_simulated_s - modelled_before) / steps


def print_async_comparison(num_running: int, rounds: int) -> None:
    """Alternate sync and async rounds (A B A B) and keep each mode's best round."""
    best: dict[bool, tuple[float, float]] = {}
    for _ in range(rounds):
        for mode in (False, True):
            wall, gpu = async_step_time(mode, num_running)
            if mode not in best or wall < best[mode][0]:
                best[mode] = (wall, gpu)
    print(f"\n| {num_running} running decodes, simulated H100 | modelled GPU ms/step | "
          "engine step ms | step / GPU |\n|---|---:|---:|---:|")
    for mode, name in ((False, "sync (GPU + CPU)"), (True, "async scheduling")):
        wall, gpu = best[mode]
        print(f"| {name} | {gpu * 1000:.2f} | {wall * 1000:.2f} | {wall / gpu:.3f}x |",
              flush=True)


# ---------------------------------------------------------------------------- part 2
MODES = {  # name -> engine kwargs
    "continuous": dict(batching="continuous"),
    "static": dict(batching="static"),  # finished rows pad until the batch ends (HF, FT)
}
MAX_BATCHED_TOKENS = 512  # the chunked-prefill budget, given to transformers' batching too
# Where both engines spend their time in the same oneDNN GEMMs (issue 38's second workload).
PREFILL_HEAVY = {"prompt_buckets": (LengthBucket("long", 2048, 4096, 1.0),),
                 "output_lengths": OutputLengths.uniform(16, 64)}


def engine_throughput(workload: list[WorkloadRequest], mode: str, concurrency: int,
                      model: str, threads: int, dtype: str = "float32",
                      max_batched_tokens: int = MAX_BATCHED_TOKENS, label: str = "",
                      **engine: str) -> ThroughputResult:
    kv_bytes = 3 * 1024**3  # every running request's full context fits: no preemption
    llm = LLM(model, dtype=dtype, max_num_seqs=concurrency, cpu_kv_cache_bytes=kv_bytes,
              enable_prefix_caching=False, cpu_threads=threads,
              max_num_batched_tokens=max_batched_tokens, **MODES[mode], **engine)
    params = [SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
              for w in workload]
    llm.generate([workload[0].prompt_token_ids], [params[0]])  # warm up
    start = time.perf_counter()
    results = llm.generate([w.prompt_token_ids for w in workload], params)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    expected = sum(w.max_tokens for w in workload)
    if tokens != expected:
        raise RuntimeError(f"{mode}: generated {tokens} tokens, expected {expected}")
    # Which CPU path each part ran, read after the run: a fallback mid-run shows too.
    paths = llm.engine.runner.cpu_paths
    shown = ", ".join(f"{part} {path}" for part, path in paths.items())
    name = (f"iterserve {mode}" + ("" if dtype == "float32" else f" {dtype}")
            + (f", {label}" if label else "") + (f" [{shown}]" if shown else ""))
    return ThroughputResult(name, seconds, tokens, torch.get_num_threads(),
                            llm.engine.scheduler.num_preemptions,
                            fallback=any("fallback" in path for path in paths.values()),
                            token_ids=[list(r.outputs[0].token_ids) for r in results])


# The ablation: each CPU path back to today's (issue 38), one at a time and all together.
TODAY = {"cpu_linear": "torch", "cpu_prefill_attention": "loop", "cpu_decode_attention": "loop",
         "cpu_elementwise": "eager"}
ABLATION = {
    "continuous F.linear": ("F.linear", {"cpu_linear": "torch"}),
    "continuous loop prefill": ("loop prefill", {"cpu_prefill_attention": "loop"}),
    "continuous loop decode": ("loop decode", {"cpu_decode_attention": "loop"}),
    "continuous eager elementwise": ("eager elementwise", {"cpu_elementwise": "eager"}),
    "continuous today": ("today's path", TODAY),
}


Contender = Callable[[], ThroughputResult]


def contenders(args: argparse.Namespace, workload: list[WorkloadRequest]) -> dict[str, Contender]:
    model = str(resolve_model_path(args.model))
    budget = args.max_batched_tokens
    runs: dict[str, Contender] = {
        mode: (lambda mode=mode: engine_throughput(workload, mode, args.concurrency, model,
                                                   args.threads, max_batched_tokens=budget))
        for mode in MODES}
    if args.ablation:
        for name, (label, engine) in ABLATION.items():
            runs[name] = (lambda label=label, engine=engine: engine_throughput(
                workload, "continuous", args.concurrency, model, args.threads,
                max_batched_tokens=budget, label=label, **engine))
    if args.also_bf16:
        runs["continuous bf16"] = lambda: engine_throughput(
            workload, "continuous", args.concurrency, model, args.threads, "bfloat16")
    if args.also_one_thread and args.threads != 1:
        runs["continuous 1 thread"] = lambda: engine_throughput(
            workload, "continuous", args.concurrency, model, 1)
    if not args.skip_hf:
        # Loaded once (HF dequantizes slowly) and bound into the lambdas, not closed over: a
        # closure would see any later rebinding or `del` of the name.
        hf = load_hf_model(resolve_model_path(args.model))
        runs["hf generate"] = lambda hf=hf: hf_generate(hf, workload, args.concurrency)
        runs["hf continuous"] = lambda hf=hf: hf_continuous(hf, workload, args.concurrency,
                                                            budget)
    if args.vllm_python:
        source = load_hf_model(resolve_model_path(args.model))
        model_dir, workload_file = prepare_vllm_inputs(
            source, resolve_model_path(args.model), workload, Path(args.vllm_workdir))
        del source
        every_core = f"0-{(os.cpu_count() or 1) - 1}"
        for name, setup in (("vllm default", VllmSetup("default binding", None)),
                            ("vllm all cores", VllmSetup("compute on every core", every_core))):
            runs[name] = lambda setup=setup: vllm_cpu(args.vllm_python, model_dir, workload_file,
                                                      args.concurrency, budget, setup,
                                                      max_model_len(workload))
    return runs


def print_table(rounds: dict[str, list[ThroughputResult | None]]) -> None:
    """Best and median tokens/s per contender, and iterserve continuous over it: the ratio of
    medians and the range of the per-round ratios (the rounds alternate, so a round's ratio
    compares runs that met the same machine). A round a contender skipped is None."""
    base = rounds["continuous"]
    print("\n| engine | threads | rounds | tokens/s best | tokens/s median | output tokens | "
          "iterserve continuous / this (median; per round) | preemptions |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for results in rounds.values():
        ran = [r for r in results if r is not None]
        best = max(ran, key=lambda r: r.tokens_per_s)
        median = statistics.median(r.tokens_per_s for r in ran)
        base_median = statistics.median(r.tokens_per_s for r in base if r is not None)
        paired = [b.tokens_per_s / r.tokens_per_s for b, r in zip(base, results, strict=True)
                  if b is not None and r is not None]
        spread = (f"{min(paired):.2f}-{max(paired):.2f}x" if len(paired) > 1
                  else f"{paired[0]:.2f}x" if paired else "-")
        ratio = f"{base_median / median:.2f}x; {spread}"
        if any(r.fallback for r in ran + [b for b in base if b is not None]):
            ratio = "none: a CPU path fell back"
        print(f"| {best.name} | {best.threads} | {len(ran)} | {best.tokens_per_s:.1f} | "
              f"{median:.1f} | {best.output_tokens} | {ratio} | {best.preemptions} |")
    print_token_differences(rounds)


def print_token_differences(rounds: dict[str, list[ThroughputResult | None]]) -> None:
    """How many requests' greedy tokens differ between the fast paths and today's (near-ties
    may flip at 1e-5 differences in the logits): reported, not hidden."""
    ours, today = rounds.get("continuous"), rounds.get("continuous today")
    if not ours or not today or ours[-1] is None or today[-1] is None:
        return
    pairs = list(zip(ours[-1].token_ids or [], today[-1].token_ids or [], strict=True))
    differ = [i for i, (a, b) in enumerate(pairs) if a != b]
    first = [next(j for j, (x, y) in enumerate(zip(*pairs[i], strict=True)) if x != y)
             for i in differ]
    print(f"\nrequests whose greedy tokens differ from today's path: {len(differ)} of "
          f"{len(pairs)}" + (f" (first differing token at {first})" if differ else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["all", "sched", "async", "throughput"], default="all",
                        help="which part to run: scheduler overhead, async vs sync, throughput, or "
                             "all")
    parser.add_argument("--num-requests", type=int, default=64,
                        help="requests in the throughput workload")
    parser.add_argument("--concurrency", type=int, default=32,
                        help="requests in flight at once (the batch)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the throughput workload")
    parser.add_argument("--model", default=None,
                        help="GGUF file, checkpoint folder or iterserve-tiny (default: built-in)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads for every contender (default: every core)")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the HF transformers contenders")
    parser.add_argument("--also-bf16", action="store_true", help="add iterserve continuous, bf16")
    parser.add_argument("--also-one-thread", action="store_true",
                        help="add iterserve continuous on one torch thread")
    parser.add_argument("--only", default=None,
                        help="comma-separated contenders to run (continuous,static,hf generate,...)")
    parser.add_argument("--workload", choices=["mixed", "prefill-heavy"], default="mixed",
                        help="mixed: the workload above; prefill-heavy: prompts of 2048-4096 "
                             "tokens, outputs of 16-64")
    parser.add_argument("--max-batched-tokens", type=int, default=MAX_BATCHED_TOKENS,
                        help="step budget for every engine (chunked prefill)")
    parser.add_argument("--ablation", action="store_true",
                        help="add iterserve continuous with each CPU path back to today's, "
                             "and with all of them (and count requests whose tokens differ)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    parser.add_argument("--once", default="",
                        help="comma-separated contenders to run in the last round only (the HF "
                             "ones take ~31 minutes a round on the built-in model)")
    parser.add_argument("--vllm-python", default=None,
                        help="interpreter of a venv with vllm-cpu: adds vLLM's CPU build, with "
                             "its default thread binding and bound to every core")
    parser.add_argument("--vllm-workdir", default="/tmp/iterserve-vllm-bench",
                        help="where the fp32 checkpoint and workload for vLLM are written")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {cpu_model_name()} ({platform.machine()}, {os.cpu_count()} cores), "
          f"{args.threads} torch threads, torch {torch.__version__}, "
          f"python {platform.python_version()}")
    if args.part in ("all", "sched"):
        print("\n| running requests | scheduler + input prep per step, CPU ms | wall ms |"
              "\n|---:|---:|---:|")
        for n in (64, 256, 1024):
            cpu = min(scheduler_step_time(n) for _ in range(args.rounds))
            wall = min(scheduler_step_time(n, clock=time.perf_counter)
                       for _ in range(args.rounds))
            print(f"| {n} | {cpu * 1000:.3f} | {wall * 1000:.3f} |", flush=True)
    if args.part in ("all", "async"):
        print_async_comparison(256, args.rounds)
    if args.part in ("all", "throughput"):
        from iterserve.autoscale.sim.workload import make_workload

        vocab = model_vocab_size(args.model)
        shape = PREFILL_HEAVY if args.workload == "prefill-heavy" else {}
        workload = make_workload(args.num_requests, seed=args.seed, vocab_size=vocab,
                                 min_token_id=32, **shape)
        print(f"\nmodel {resolve_model_path(args.model).name}; workload: {len(workload)} requests, "
              f"seed {args.seed}, {sum(len(w.prompt_token_ids) for w in workload)} prompt "
              f"tokens, {sum(w.max_tokens for w in workload)} output tokens, concurrency "
              f"{args.concurrency}", flush=True)
        runs = contenders(args, workload)
        if args.only:
            runs = {k: v for k, v in runs.items() if k in args.only.split(",")}
        run_rounds(runs, args.rounds, set(filter(None, args.once.split(","))), args.threads)


def run_rounds(runs: dict[str, Contender], num_rounds: int, once: set[str],
               threads: int) -> None:
    """Every contender once per round, in the same order each round (A B C, A B C, ...), then
    the table; the load average at each run's start is printed with it."""
    rounds: dict[str, list[ThroughputResult | None]] = {name: [] for name in runs}
    loads = []
    for index in range(num_rounds):
        for name, run in runs.items():
            if index < num_rounds - 1 and name in once:
                rounds[name].append(None)
                continue
            torch.set_num_threads(threads)  # an engine run may have changed it
            loads.append(os.getloadavg()[0])
            result = run()
            rounds[name].append(result)
            print(f"  round {index + 1} {result.name}: {result.seconds:.1f} s "
                  f"({result.tokens_per_s:.1f} tok/s; load average {loads[-1]:.2f} at start)",
                  flush=True)
    print_table(rounds)
    print(f"\nload average (1 min) at the runs' starts: {min(loads):.2f}-{max(loads):.2f}")


def max_model_len(workload: list[WorkloadRequest]) -> int:
    """A context length that holds the workload's longest request (vLLM preallocates for it)."""
    longest = max(len(w.prompt_token_ids) + w.max_tokens for w in workload)
    return max(2048, -(-longest // 1024) * 1024)


def model_vocab_size(model: str | None) -> int:
    """The model's vocabulary size (prompt token ids are drawn below it)."""
    from iterserve.replica.loader import read_model_config

    return read_model_config(resolve_model_path(model)).vocab_size


if __name__ == "__main__":
    main()
