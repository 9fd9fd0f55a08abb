"""Offline engine benchmark: prints figures, asserts nothing (floors live in BENCHMARKS.md).

    python -m iterserve.replica.bench                 # all three parts
    python -m iterserve.replica.bench --part sched    # scheduler overhead only

1. Scheduler + input preparation CPU time per step at 64, 256 and 1024 running requests,
   over the null runner (no model): what the engine itself costs per iteration.
2. Offline throughput, static vs continuous batching, on one seeded mixed workload (prompts
   short 16-64 / medium 128-384 / long 512-1024 tokens at 0.5/0.3/0.2; outputs exponential
   mean 128 capped to [8, 512]; ignore_eos), 64 concurrent, on the default tiny model.
3. The same workload through HF transformers `generate` in padded static batches of 64.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from iterserve.replica.block_manager import BlockManager
from iterserve.replica.config import SchedulerConfig
from iterserve.replica.input_batch import prepare_inputs
from iterserve.replica.llm import LLM
from iterserve.replica.make_model import default_model_path
from iterserve.replica.null_runner import NullRunner
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.scheduler import Scheduler

if TYPE_CHECKING:
    from iterserve.loadtests.workload import WorkloadRequest


# ---------------------------------------------------------------------------- part 1
def scheduler_step_time(num_running: int, steps: int = 50, block_size: int = 16) -> float:
    """Mean seconds of schedule() + prepare_inputs() + update() with num_running decodes."""
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
    while any(r.num_output_tokens == 0 for r in scheduler.running) or scheduler.num_waiting:
        output = scheduler.schedule()
        scheduler.update(output, runner.execute(output))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        output = scheduler.schedule()
        prepare_inputs(output, block_size)
        before_runner = time.perf_counter()
        sampled = runner.execute(output)  # the model's part: excluded from the timing
        after_runner = time.perf_counter()
        scheduler.update(output, sampled)
        end = time.perf_counter()
        times.append((before_runner - start) + (end - after_runner))
    return statistics.median(times)


# ---------------------------------------------------------------------------- part 2
@dataclass
class ThroughputResult:
    name: str
    seconds: float
    output_tokens: int
    preemptions: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


MODES = {  # name -> engine kwargs
    "continuous": dict(batching="continuous"),
    "static": dict(batching="static"),  # finished rows pad until the batch ends (HF, FT)
    "static, rows leave": dict(batching="static", static_batch_padding=False),
}


def engine_throughput(workload: list[WorkloadRequest], mode: str, concurrency: int,
                      model: str) -> ThroughputResult:
    llm = LLM(model, max_num_seqs=concurrency, cpu_kv_cache_bytes=2 * 1024**3,
              enable_prefix_caching=False, **MODES[mode])
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
    return ThroughputResult(f"iterserve {mode}", seconds, tokens,
                            llm.engine.scheduler.num_preemptions)


def hf_throughput(workload: list[WorkloadRequest], batch_size: int, model: str) -> ThroughputResult:
    """HF transformers generate() in left-padded static batches (each runs to its longest)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # ignore_eos, as in the engine runs
    pad = 0
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(workload), batch_size):
        batch = workload[i : i + batch_size]
        width = max(len(w.prompt_token_ids) for w in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, w in enumerate(batch):
            n = len(w.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(w.prompt_token_ids)
            mask[row, width - n :] = 1
        new_tokens = max(w.max_tokens for w in batch)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                        do_sample=False, pad_token_id=pad)
        useful += sum(w.max_tokens for w in batch)  # tokens past a request's own length are waste
    return ThroughputResult("HF transformers generate", time.perf_counter() - start, useful)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["all", "sched", "throughput"], default="all")
    parser.add_argument("--num-requests", type=int, default=192)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: built-in)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds per mode")
    args = parser.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"torch threads, torch {torch.__version__}, python {platform.python_version()}")
    if args.part in ("all", "sched"):
        print("\n| running requests | scheduler + input prep per step (ms) |\n|---:|---:|")
        for n in (64, 256, 1024):
            print(f"| {n} | {scheduler_step_time(n) * 1000:.3f} |", flush=True)
    if args.part in ("all", "throughput"):
        from iterserve.loadtests.workload import make_workload

        model = args.model or str(default_model_path())
        workload = make_workload(args.num_requests, seed=args.seed, vocab_size=4096)
        print(f"\nworkload: {len(workload)} requests, seed {args.seed}, "
              f"{sum(len(w.prompt_token_ids) for w in workload)} prompt tokens, "
              f"{sum(w.max_tokens for w in workload)} output tokens, "
              f"concurrency {args.concurrency}", flush=True)
        # Alternate the modes round by round and keep each one's best round, so that noise
        # from other processes on a shared machine hits both alike.
        best: dict[str, ThroughputResult] = {}
        for _ in range(args.rounds):
            for mode in MODES:
                result = engine_throughput(workload, mode, args.concurrency, model)
                print(f"  {result.name}: {result.seconds:.1f} s", flush=True)
                if mode not in best or result.seconds < best[mode].seconds:
                    best[mode] = result
        results = [best[mode] for mode in MODES]
        if not args.skip_hf:
            results.append(hf_throughput(workload, args.concurrency, model))
        base = results[0]
        print("\n| engine | seconds | output tokens | tokens/s | continuous / this | preemptions |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in results:
            print(f"| {r.name} | {r.seconds:.1f} | {r.output_tokens} | {r.tokens_per_s:.0f} | "
                  f"{base.tokens_per_s / r.tokens_per_s:.2f}x | {r.preemptions} |")


if __name__ == "__main__":
    main()
