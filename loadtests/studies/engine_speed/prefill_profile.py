"""Where one prefill chunk's time goes in the engine, part by part: prints figures, asserts nothing.

    python -m iterserve.loadtests.studies.engine_speed.prefill_profile --tokens 512 --threads 2
    python -m iterserve.loadtests.studies.engine_speed.prefill_profile --cpu-elementwise eager

Builds the engine on the built-in SmolLM2, runs single prompts of `--tokens` tokens (one chunk at
the default 512-token budget, one output token) under torch.profiler, with every kernel op of
the model (`Ops`: norms, rotary, SiLU*mul, KV writes, attention) and every Linear wrapped in a
labelled region, and prints each region's milliseconds per prompt beside the engine's whole
step, then the profiler's own table of the slowest aten ops. The regions nest nothing but
aten ops, so what the step takes beyond their sum is Python: scheduling, inputs, sampling.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import random
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function

from iterserve.replica.llm import LLM
from iterserve.replica.model_source import resolve_model_path
from iterserve.replica.models.layers import Linear
from iterserve.replica.sampling_params import SamplingParams

REGION = "part:"


def labelled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with record_function(REGION + name):
            return fn(*args, **kwargs)

    return call


def label_parts(llm: LLM) -> None:
    """Every model op and Linear of this engine's model runs inside a labelled region."""
    runner = llm.engine.runner
    ops = runner.ops
    wrapped = dataclasses.replace(ops, **{f.name: labelled(f.name, getattr(ops, f.name))
                                          for f in dataclasses.fields(ops) if f.name != "name"})
    for module in runner.model.modules():
        if hasattr(module, "ops"):
            module.ops = wrapped
        if isinstance(module, Linear):
            module.forward = labelled("linear", module.forward)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512, help="prompt length (one chunk)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--prompts", type=int, default=4, help="profiled prompts (after one)")
    parser.add_argument("--cpu-elementwise", default="auto", choices=["auto", "compiled", "eager"],
                        help="the engine's cpu_elementwise setting")
    parser.add_argument("--top", type=int, default=20, help="aten ops listed, by self time")
    args = parser.parse_args(argv)
    llm = LLM(str(resolve_model_path(None)), dtype="float32", cpu_threads=args.threads,
              enable_prefix_caching=False, max_num_batched_tokens=max(512, args.tokens),
              cpu_kv_cache_bytes=2**30, cpu_elementwise=args.cpu_elementwise)
    print(f"paths: {llm.engine.runner.cpu_paths}; load average {os.getloadavg()[0]:.2f}")
    label_parts(llm)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.tokens)]
               for _ in range(args.prompts + 1)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([prompts[0]], [params])  # warm up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for prompt in prompts[1:]:
            with record_function(REGION + "whole step"):
                llm.generate([prompt], [params])
    events = sorted((e for e in prof.key_averages() if e.key.startswith(REGION)),
                    key=lambda e: -e.cpu_time_total)
    print("\n| part | calls per prompt | ms per prompt | ms per token |\n|---|---:|---:|---:|")
    for event in events:
        ms = event.cpu_time_total / args.prompts / 1e3
        print(f"| {event.key[len(REGION):]} | {event.count // args.prompts} | {ms:.1f} | "
              f"{ms / args.tokens:.4f} |")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
